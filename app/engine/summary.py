"""What the start of the log says: the data the run learns from, the model (parameters, size, and
where and how the run computes), and when training stops and which weights ``model/`` gets."""

from __future__ import annotations

from typing import Any

from torch import nn

from app.config import ExportChoice, RunConfig
from app.engine.adapters import describe
from app.tasks.base import DescribesData, Task, TaskData


def data_summary(task: Task, data: TaskData) -> str:
    """e.g. ``train: 200 rows of train.csv; evaluation: 40 rows of validation.csv; labels no=0, yes=1;
    ...``: the task's own account (:class:`app.tasks.base.DescribesData`), else each split's size."""
    if isinstance(task, DescribesData) and (facts := task.data_summary()):
        return "; ".join(facts)
    splits = {"train": data.train, "evaluation": data.eval, **{f"evaluation {n}": d for n, d in data.extra_eval.items()}}
    return "; ".join(f"{name}: {_size(split)}" for name, split in splits.items())


def _size(split: Any) -> str:
    try:
        return f"{len(split):,} samples"
    except TypeError:
        return "a stream"


def model_summary(model: nn.Module, hardware: str, device: object, precision: str, threads: object = None) -> str:
    """e.g. ``model MLP: 17,226 parameters (17,226 trainable, 100 %; 0 frozen), 0.07 MB; hardware cpu
    on cpu, precision no, 1 thread (small model)``: ``threads`` is torch's intra-op threads and why
    (``app.engine.threads``); with LoRA adapters, the model's class and theirs
    (``BertForSequenceClassification with LoRA adapters (r=8, …) on query, value``) and the small
    trainable share. Sharded parameters count with their full size."""
    total = trainable = size = 0
    for p in model.parameters():
        total += p.numel()
        size += p.numel() * p.element_size()
        if p.requires_grad:
            trainable += p.numel()
    return (f"model {describe(model)}: {total:,} parameters ({trainable:,} trainable, {percent(trainable, total)}; "
            f"{total - trainable:,} frozen), {size / 2**20:.2f} MB; hardware {hardware} on {device}, "
            f"precision {precision}" + ("" if threads is None else f", {threads}"))


def percent(part: int, whole: int) -> str:
    """``0.33 %``, ``12 %``, ``100 %``: two significant figures below 10 %."""
    share = 100 * part / whole if whole else 0.0
    return f"{share:.2g} %" if share < 10 else f"{share:.0f} %"


def stopping_summary(cfg: RunConfig) -> str:
    """e.g. ``early stopping: off (early_stopping.patience=N stops after N evaluations without a better
    eval/loss); model/: the best evaluation by eval/loss (lowest; checkpoint.export=last: the final
    weights)``: whether the run may stop before its steps, and what it exports."""
    es = cfg.early_stopping
    better = "highest" if es.mode.value == "max" else "lowest"
    if es.patience is None:
        stopping = (f"early stopping: off, every step asked for is trained (early_stopping.patience=N stops after N "
                    f"evaluations without a better {es.monitor})")
    else:
        margin = f" by more than {es.min_delta:g}" if es.min_delta else ""
        stopping = (f"early stopping: after {es.patience} evaluation(s) without a better {es.monitor}{margin} "
                    "(early_stopping.patience=null trains every step asked for)")
    if not cfg.checkpoint.save_final_model:
        export = "no model/ (checkpoint.save_final_model=false)"
    elif cfg.checkpoint.resolved_export() is ExportChoice.best:
        export = f"model/: the best evaluation by {es.monitor} ({better}; checkpoint.export=last: the final weights)"
    else:
        export = "model/: the final weights (checkpoint.export=last)"
    return f"{stopping}; {export}"
