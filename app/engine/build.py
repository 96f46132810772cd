"""Setup, in small ``build_*`` functions: the only place where config values become objects."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Subset

from app.config import ConfigError, RunConfig, as_plain
from app.distributed import Accelerator, LengthGroupedSampler
from app.distributed.data.stream import ShardedStream
from app.distributed.hardware import build_backend
from app.engine.activation_checkpointing import enable_gradient_checkpointing
from app.engine.adapters import attach_adapter
from app.engine.loop import Components, batches_per_pass, total_optimizer_steps
from app.engine.parameter_groups import freeze_parameters, parameter_groups
from app.engine.summary import data_summary
from app.engine.threads import choose_threads, use_threads
from app.engine.triggers import EarlyStopping
from app.engine.weight_average import WeightAverage
from app.run_folder.layout import SKIPPED_ROWS_FILE
from app.tasks import build_task
from app.tasks.base import BatchPlan, MakesTrainingBatches, SkipsRows, Task, TaskData

log = logging.getLogger(__name__)


def build_accelerator(cfg: RunConfig, run_dir: Path) -> Accelerator:
    return Accelerator(
        mixed_precision=cfg.precision.mode.value,
        gradient_accumulation_steps=cfg.trainer.gradient_accumulation_steps,
        project_dir=run_dir,
        log_with=["jsonl", *(t.value for t in cfg.logging.trackers)],
        backend=build_backend(cfg.hardware),
        seed=cfg.seed,
        # Our choice: one scheduler step per optimizer step on any number of processes (the
        # schedule is sized in optimizer steps by total_optimizer_steps), not Accelerate's one per process.
        scale_scheduler_by_processes=False,
    )


def build_components(cfg: RunConfig, accelerator: Accelerator, task: Task | None = None,
                     saved_adapter: Path | None = None) -> Components:
    """``saved_adapter``: a peft adapter folder to put on the task's model instead of new adapters
    (mode=eval of an export without merged weights)."""
    task = task if task is not None else build_task(cfg.task)
    check_monitor(cfg, task)
    data = debug_subsets(cfg, task.build_data(accelerator))
    check_monitor(cfg, task)  # again: a task may learn its metrics from its data (text_classification's problem)
    streamed = check_streamed(task, data)
    log.info("data: %s", data_summary(task, data))
    write_skipped_rows(task, accelerator)
    # A task that makes its micro-batches from its loader's batches (task=grpo: prompts -> completions) says
    # how many rows a loader batch holds and how many micro-batches it makes (app/tasks/base.py).
    plan = batch_plan(cfg, task, accelerator.num_processes)
    rows = cfg.trainer.batch_size * (plan.draws if plan is not None else 1)
    if not streamed:
        check_batch_fits(cfg, len(data.train), accelerator.num_processes, rows)  # type: ignore[arg-type]
    model = task.build_model()
    # Before any work on the model: a small one trains fastest on one thread (app/engine/threads.py).
    threads = choose_threads(cfg.hardware.num_threads, sum(p.numel() for p in model.parameters()))
    use_threads(threads)
    frozen = freeze_parameters(model, list(cfg.optim.freeze))
    if frozen:
        log.info("not training %d parameter tensor(s) (optim.freeze): %s", len(frozen), ", ".join(frozen))
    if cfg.trainer.gradient_checkpointing:
        log.info("gradient checkpointing: %s", enable_gradient_checkpointing(model, task))
    model = attach_adapter(model, cfg.adapter, task, saved=saved_adapter)  # adapter=none: the model itself
    train_loader = DataLoader(data.train, batch_size=rows, collate_fn=data.collate_fn,
                              num_workers=cfg.trainer.num_workers, drop_last=plan is not None,
                              **({} if streamed else train_sampling(cfg, task, data)))
    eval_loader, *extra_loaders = (
        DataLoader(dataset, batch_size=cfg.trainer.eval_batch_size or cfg.trainer.batch_size, shuffle=False,
                   collate_fn=data.collate_fn, num_workers=cfg.trainer.num_workers)
        for dataset in (data.eval, *data.extra_eval.values()))
    # The model must be wrapped before the optimizer sees its parameters (FSDP2 replaces them), and
    # the scheduler needs the number of optimizer steps, which depends on the sharded loader length.
    if cfg.trainer.compile:
        # In place (nn.Module.compile): parameter names, checkpoints and exports stay as without it.
        model.compile()
    model = accelerator.prepare(model)
    optimizer = build_optimizer(cfg, model, fused_available=accelerator.fused_optimizers)
    optimizer = accelerator.prepare(optimizer)
    prepared, eval_loader, *extra_loaders = accelerator.prepare(train_loader, eval_loader, *extra_loaders)
    if plan is not None:
        assert isinstance(task, MakesTrainingBatches)  # batch_plan made a plan
        log.info("%s", plan.sentence)
        prepared = accelerator.expand_batches(
            prepared, lambda batch, step: task.training_batches(model, batch, step), plan.micro_batches,
            task.pending_batches, batch_size=plan.samples)
    scheduler = instantiate(cfg.scheduler, optimizer=optimizer.optimizer,
                            total_steps=total_optimizer_steps(cfg, batches_per_pass(prepared)))
    scheduler = accelerator.prepare(scheduler)
    average = WeightAverage(model, cfg.trainer.ema_decay) if cfg.trainer.ema_decay is not None else None
    return Components(accelerator, task, model, optimizer, scheduler, prepared, eval_loader, average,
                      show_progress=accelerator.is_main_process and cfg.logging.progress_bar,
                      extra_eval_loaders=dict(zip(data.extra_eval, extra_loaders)), threads=threads)


def write_skipped_rows(task: Task, accelerator: Accelerator) -> None:
    """``<run>/skipped_rows.jsonl``: the rows the task left out (``task.bad_rows=skip``), on the main process."""
    if not isinstance(task, SkipsRows) or not accelerator.is_main_process or accelerator.project_dir is None:
        return
    skipped = task.skipped_rows()
    if skipped:
        path = accelerator.project_dir / SKIPPED_ROWS_FILE
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in skipped), encoding="utf-8")
        log.info("%d bad row(s) left out of the data, each with its reason: %s", len(skipped), path)


def check_monitor(cfg: RunConfig, task: Task) -> None:
    """``early_stopping.monitor`` must be a metric the task reports (before any data is loaded)."""
    names = [f"eval/{m}" for m in (*task.metric_names, "num_samples")]
    if names[:-1] and cfg.early_stopping.monitor not in names:
        raise ConfigError(f"early_stopping.monitor={cfg.early_stopping.monitor} is not a metric the task "
                          f"{task.name} reports; choose one of {', '.join(names[:-1])}.")


def check_streamed(task: Task, data: TaskData) -> bool:
    """Whether the training split is a stream; one the runtime cannot resume exactly is refused (the
    config's rules for streams, ``RunConfig.check_streamed_training``, have passed already)."""
    if not isinstance(data.train, IterableDataset):
        return False
    if not isinstance(data.train, ShardedStream):
        raise ConfigError(f"the task {task.name} gives an IterableDataset for training that does not shard and "
                          "checkpoint itself (app.distributed.data.stream.ShardedStream); the engine trains on such "
                          "streams only, so that a resumed run continues exactly.")
    return True


def batch_plan(cfg: RunConfig, task: Task, processes: int) -> BatchPlan | None:
    """The task's plan for its loader batches (:class:`MakesTrainingBatches`); None for a task that trains on them."""
    if not isinstance(task, MakesTrainingBatches):
        return None
    return task.batch_plan(cfg.trainer.batch_size, cfg.trainer.gradient_accumulation_steps, processes)


def check_batch_fits(cfg: RunConfig, train_samples: int, processes: int, rows: int | None = None) -> None:
    """A per-process batch larger than a process's share of the training set cannot be filled (``rows``:
    a loader batch's, where a task draws several micro-batches' worth at once)."""
    share = train_samples // processes
    rows = rows if rows is not None else cfg.trainer.batch_size
    if rows > share:
        per = rows // cfg.trainer.batch_size
        fits = max(share // per, 1)
        drawn = f" ({per} micro-batches' worth drawn at once)" if per > 1 else ""
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size}{drawn} is more than the {share} training samples each of the "
            f"{processes} process(es) gets ({train_samples} in all); use trainer.batch_size={fits} or less.")


def build_optimizer(cfg: RunConfig, model: nn.Module, fused_available: bool = False) -> torch.optim.Optimizer:
    options = as_plain(cfg.optim)
    del options["layer_decay"]  # ours, not the optimizer's
    del options["freeze"]  # applied to the model already: its parameters no longer require grad
    if "fused" in options and options["fused"] is None:
        options["fused"] = fused_available or None  # None: torch's own default (foreach or a loop)
    groups = parameter_groups(model, cfg.optim.weight_decay, lr=cfg.optim.lr, layer_decay=cfg.optim.layer_decay)
    # Partial, then called: instantiate would turn the parameter-group dicts into DictConfigs. "all":
    # plain lists (betas), which the checkpoint format stores (torch < 2.10 keeps them as given).
    return instantiate(options, _partial_=True, _convert_="all")(params=groups)


def debug_subsets(cfg: RunConfig, data: TaskData) -> TaskData:
    """trainer.overfit_batches: train and evaluate on the same first batches; trainer.limit_eval_batches:
    evaluate on the first batches only."""
    t = cfg.trainer
    if t.overfit_batches:
        n = min(len(data.train), t.overfit_batches * t.batch_size)  # type: ignore[arg-type]
        few = Subset(data.train, range(n))
        lengths = list(data.train_lengths[:n]) if data.train_lengths is not None else None
        return dataclasses.replace(data, train=few, eval=few, train_lengths=lengths,
                                   extra_eval={name: few for name in data.extra_eval})
    if t.limit_eval_batches:
        limit = t.limit_eval_batches * (t.eval_batch_size or t.batch_size)

        def first(dataset: Any) -> Subset:
            return Subset(dataset, range(min(len(dataset), limit)))

        return dataclasses.replace(data, eval=first(data.eval),
                                   extra_eval={name: first(d) for name, d in data.extra_eval.items()})
    return data


def train_sampling(cfg: RunConfig, task: Task, data: TaskData) -> dict[str, Any]:
    """DataLoader arguments for the training order: a plain shuffle, or one grouped by length."""
    if cfg.trainer.overfit_batches:
        return {"shuffle": False}  # the same few batches, in the same order, every epoch
    if not cfg.trainer.group_by_length:
        return {"shuffle": True}
    if data.train_lengths is None:
        raise ConfigError(
            f"trainer.group_by_length=true needs sample lengths, and the task {task.name} does not give "
            "them (its samples all cost the same); leave trainer.group_by_length=false."
        )
    return {"sampler": LengthGroupedSampler(data.train_lengths, cfg.trainer.batch_size, seed=cfg.seed)}


def build_early_stopping(cfg: RunConfig) -> EarlyStopping:
    es = cfg.early_stopping
    return EarlyStopping(es.monitor, es.mode.value, es.patience, es.min_delta)
