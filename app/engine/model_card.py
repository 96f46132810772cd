"""``model/README.md``: the model card written with every export, as the Hugging Face Hub's model cards
are (YAML metadata, then markdown): what the model is (task, base model, adapter), what it was
trained on (data and split sizes), how (the hyperparameters that matter; hardware, precision and
processes; the training time), how well (the exported weights' evaluation, and a sweep job's place in
its sweep), the command that reproduces it, how to load it, and a licence left for the user to set.

It is rendered from what the run knows at its end: the config, the prepared loaders' sizes, the
metrics logged at the exported step (``metrics.jsonl``), ``export.json``'s metadata and Hydra's
record of the command line (``.hydra/``, absent for a run started in-process).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from app.config import LoraAdapterConfig, RunConfig
from app.engine.adapters import PEFT_TASK_TYPES, describe, is_adapted
from app.engine.loop import Components
from app.engine.progress import human
from app.engine.result import FINISHED, read_result
from app.engine.run_record import RunRecord, read_run_record
from app.run_folder.layout import ADAPTER_DIR, metrics_file
from app.tasks.base import DescribesItself, PacksSamples

LICENCE_TODO = ("Not set. Choose the licence under which you share this model; the base model's and the "
                "training data's own terms apply to it too.")


def model_card(cfg: RunConfig, c: Components, run_dir: Path, export: dict[str, Any], wall_time_s: float) -> str:
    """The card's markdown for the weights ``export`` describes (``export.json``'s metadata)."""
    acc, task = c.accelerator, c.task
    model = acc.unwrap_model(c.model)
    record = read_run_record(run_dir)
    facts = task.card_facts() if isinstance(task, DescribesItself) else {}
    base = facts.get("base model", f"{describe(model)} (built by the task {task.name})")
    evaluation = exported_metrics(run_dir, int(export["step"]))
    adapter = cfg.adapter if isinstance(cfg.adapter, LoraAdapterConfig) else None
    transformers_model = hasattr(model, "config") and hasattr(getattr(model, "config", None), "to_dict")

    lines = front_matter(cfg, task.name, base if "base model" in facts else None, evaluation,
                         "peft" if adapter else "transformers" if transformers_model else None)
    lines += [f"# {task.name}: {facts.get('title', base)}", ""]
    metric = export.get("metric") or {}
    how = f", {metric['name']} = {human(metric['value'])}" if metric else ""
    lines += [f"Fine-tuned with `app` (`python -m app`): these are the **{export['exported']}** weights, from "
              f"step {export['step']} of {export.get('final_step', export['step'])}{how}"
              + (f" (`checkpoints/{export['checkpoint']}`)." if export.get("checkpoint") else "."), ""]

    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    about = [("task", f"`{task.name}`"), ("base model", base)]
    about += [(k, v) for k, v in facts.items() if k not in ("base model", "data", "title")]
    if adapter is not None:
        merged = "merged into this folder's weights; the adapter alone" if adapter.merge_on_export else "the adapter"
        about.append(("adapter", f"{describe(model).split(' with ', 1)[-1]} ({merged} in `{ADAPTER_DIR}/`)"))
    about.append(("parameters", f"{total:,}, of which {trained:,} trained ({share(trained, total)})"))
    lines += ["## Model", "", *table(("", ""), about), ""]

    loaders = [("train", c.train_loader), ("evaluation", c.eval_loader),
               *((f"evaluation `{name}`", loader) for name, loader in c.extra_eval_loaders.items())]
    lines += ["## Data", ""]
    if "data" in facts:
        lines += [facts["data"], ""]
    lines += [*table(("split", "samples"), [(name, split_size(loader)) for name, loader in loaders]), ""]

    lines += ["## Evaluation", ""]
    if evaluation:
        lines += [f"The exported weights (step {export['step']}) on the evaluation set:", "",
                  *table(("metric", "value"), [(f"`{k}`", human(v)) for k, v in evaluation.items()]), ""]
    else:
        lines += ["No evaluation was logged at the exported step.", ""]
    if record is not None and record.sweep_dir is not None:
        lines += ["### In its sweep", "", sweep_place(record, run_dir, cfg), ""]

    lines += ["## Training", "", *table(("", ""), hyperparameters(cfg, c, export, wall_time_s)), ""]
    lines += ["## Reproduce", ""]
    if record is not None:
        lines += ["```bash", record.command, "```", "",
                  ("(from the folder it was started in, with the same data and base model; the run's whole config "
                  "is its `.hydra/config.yaml`)"), ""]
    else:
        lines += [("This run was started without Hydra's command line (in-process): its config is not recorded "
                  "here."), ""]
    lines += ["## How to use", "", *usage(model, adapter, transformers_model), ""]
    lines += ["## License", "", LICENCE_TODO, ""]
    return "\n".join(lines)


def split_size(loader: Any) -> str:
    """A split's samples as the card shows them: ``1,200``; packed, the conversations or pairs, with the
    rows they fill (``400 (in 61 packed rows)``); ``streamed`` for a stream, which has no length."""
    rows = getattr(loader, "total_dataset_length", None)
    if rows is None:
        return "streamed"
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, PacksSamples):
        return f"{dataset.samples_packed():,} (in {rows:,} packed rows)"
    return f"{rows:,}"


def front_matter(cfg: RunConfig, task: str, base: str | None, evaluation: dict[str, float],
                 library: str | None) -> list[str]:
    """The Hub's metadata block; ``license`` is left empty for the user."""
    import yaml  # type: ignore[import-untyped]

    meta: dict[str, Any] = {"license": None}
    if library is not None:
        meta["library_name"] = library
    if base is not None:
        meta["base_model"] = base.strip("`").split("`")[0]
    meta["tags"] = ["app", task, *(["lora"] if isinstance(cfg.adapter, LoraAdapterConfig) else [])]
    names = [k.removeprefix("eval/") for k in evaluation if k not in ("eval/num_samples", "eval/loss")]
    if names:
        meta["metrics"] = names
    text = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip()
    text = text.replace("license: null", "license:  # yours to set, e.g. apache-2.0 (see License below)", 1)
    return ["---", text, "---", ""]


def exported_metrics(run_dir: Path, step: int) -> dict[str, float]:
    """The evaluation logged at ``step`` (the last one, should there be two), ``eval/*`` keys only."""
    found: dict[str, float] = {}
    try:
        lines = metrics_file(run_dir).read_text(encoding="utf-8").splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("step") == step and "eval/num_samples" in event:
            found = {k: v for k, v in event.items() if k.startswith("eval/")}
    return found


def sweep_place(record: RunRecord, run_dir: Path, cfg: RunConfig) -> str:
    """The job's number and overrides in its sweep, and how it ranks among the jobs finished so far."""
    monitor, larger = cfg.early_stopping.monitor, cfg.early_stopping.mode.value == "max"
    text = (f"Job {record.job} of the sweep `{record.sweep_dir}`, with "
            f"{', '.join(f'`{o}`' for o in record.overrides) or 'no overrides of its own'}.")
    others = []
    for folder in sorted(Path(record.sweep_dir or run_dir.parent).iterdir()):
        result = read_result(folder) if folder.is_dir() and folder != run_dir else None
        if result and result.get("status") == FINISHED and isinstance(result.get("best"), (int, float)):
            others.append(float(result["best"]))
    if others:
        text += (f" When it ended, {len(others)} other job(s) of the sweep had finished; their best `{monitor}`: "
                 f"{', '.join(human(v) for v in sorted(others, reverse=larger))}.")
    return text + " The sweep's ranking of all its jobs is its `sweep.md` once the sweep ends."


def hyperparameters(cfg: RunConfig, c: Components, export: dict[str, Any], wall_time_s: float) -> list[tuple[str, str]]:
    t, o, s = cfg.trainer, cfg.optim, cfg.scheduler
    processes = c.accelerator.num_processes
    rows = [
        ("optimizer", f"`{o._target_.rsplit('.', 1)[-1]}`, lr {o.lr:g}, weight decay {o.weight_decay:g}"
                      + (f", layer decay {o.layer_decay:g}" if o.layer_decay is not None else "")),
        ("schedule", f"`{s._target_.rsplit('.', 1)[-1]}`, warm-up "
                     + (f"{s.warmup_steps} steps" if s.warmup_steps else f"{s.warmup_ratio:.0%} of the steps")),
        ("batch", (f"{t.batch_size} per process × {processes} process(es) × {t.gradient_accumulation_steps} "
                  f"accumulation = {t.batch_size * processes * t.gradient_accumulation_steps}")),
        # The run's length: its last step and epochs, not those of the exported (best) evaluation.
        ("length", (f"{export.get('final_step', export['step'])} optimizer steps, "
                    f"{export.get('final_epoch', export.get('epoch', 0))} epoch(s) "
                   f"completed (trainer.max_epochs={t.max_epochs}, trainer.max_steps={t.max_steps})")),
        ("gradient clipping", f"{t.max_grad_norm:g}" if t.max_grad_norm is not None else "off"),
    ]
    if o.freeze:
        rows.append(("frozen", ", ".join(f"`{p}`" for p in o.freeze)))
    if t.ema_decay is not None:
        rows.append(("weight average", f"exponential, decay {t.ema_decay:g} (the exported weights)"))
    rows += [
        ("gradient checkpointing", "on" if t.gradient_checkpointing else "off"),
        ("hardware", f"`{cfg.hardware.kind.value}`, {processes} process(es) on {c.accelerator.device}"),
        ("precision", f"`{cfg.precision.mode.value}`"),
        ("seed", str(cfg.seed)),
        ("training time", f"{wall_time_s / 60:.1f} min ({wall_time_s:.0f} s, start-up and evaluations included)"),
    ]
    return rows


def usage(model: Any, adapter: LoraAdapterConfig | None, transformers_model: bool) -> list[str]:
    """Python that loads the folder (``<this folder>``: where the card is)."""
    if not transformers_model:
        return [("The weights are `model.safetensors` (`safetensors.torch.load_file`), with the model's key names; "
                "build the task's model and `load_state_dict` them.")]
    base = model.get_base_model() if is_adapted(model) else model
    name = type(base).__name__
    auto = next((f"AutoModel{suffix}" for suffix, _ in PEFT_TASK_TYPES if name.endswith(suffix)), "AutoModel")
    remote = ", trust_remote_code=True" if getattr(base.config, "auto_map", None) else ""
    lines = ["```python", f"from transformers import {auto}, AutoTokenizer", ""]
    if adapter is None or adapter.merge_on_export:
        lines += [f'model = {auto}.from_pretrained("<this folder>"{remote})']
    if adapter is not None:
        lines += ["", "# or the base model with the adapter on it (peft):", "from peft import PeftModel", "",
                  f'base = {auto}.from_pretrained("<base model>"{remote})  # as the task built it',
                  f'model = PeftModel.from_pretrained(base, "<this folder>/{ADAPTER_DIR}")']
    lines += ['tokenizer = AutoTokenizer.from_pretrained("<this folder>")', "```"]
    if adapter is not None:
        lines += ["", "The merged weights and the adapter on its base model predict alike."
                  if adapter.merge_on_export else "This folder holds no merged weights (adapter.merge_on_export=false)."]
    return lines


def table(header: tuple[str, str], rows: Iterable[tuple[str, str]]) -> list[str]:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    return [f"| {header[0]} | {header[1]} |", "| --- | --- |", *(f"| {cell(a)} | {cell(b)} |" for a, b in rows)]


def share(part: int, whole: int) -> str:
    """``0.33 %``: two significant figures for small shares."""
    if not whole:
        return "0 %"
    percent = 100 * part / whole
    return f"{percent:.2g} %" if percent < 10 else f"{percent:.0f} %"

