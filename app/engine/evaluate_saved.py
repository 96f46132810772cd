"""``python -m app mode=eval resume=<run folder | checkpoint | model folder>``: evaluate saved weights on
the evaluation set, on one or several processes, without training. Nothing of the trained run is
written: the metrics go to the new run folder (its log and ``eval_metrics.json``), and with
``task.predict_test=true`` the test split's predictions too (``test_predictions.tsv``).

A run folder means what the run exported (``model/``: with ``checkpoint.export=best`` its best
evaluation's weights); one without an export, its newest checkpoint. ``resume=<run>/checkpoints/checkpoint_<N>``
evaluates that checkpoint instead. The log says in one line which weights it evaluates."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from app.config import AdapterConfig, AdapterKind, RunConfig
from app.distributed.random import set_seed
from app.engine.adapters import saved_adapter
from app.engine.build import build_accelerator, build_components, build_early_stopping
from app.engine.checkpoint import CheckpointPolicy
from app.engine.checkpoint_resume import export_description, exported_model_of, is_model_folder
from app.engine.loop import LoopState, evaluate
from app.engine.predict import write_test_predictions
from app.engine.progress import human, human_metrics
from app.run_folder.layout import EVAL_METRICS_FILE, PREDICTIONS_FILE, checkpoints_dir

log = logging.getLogger(__name__)


def evaluate_saved(cfg: RunConfig, run_dir: Path) -> float:
    """The evaluation metrics of the weights ``cfg.resume`` names; returns the monitored one."""
    assert cfg.resume is not None  # validate() requires it in eval mode
    given = Path(cfg.resume)
    source = exported_model_of(given) or given
    set_seed(cfg.seed)
    accelerator = build_accelerator(cfg, run_dir)
    if not accelerator.is_main_process:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        if is_model_folder(source):
            # An export holds the weights that were evaluated (the average, with trainer.ema_decay). A run
            # with adapters (its recorded adapter=lora) is evaluated as it trained: its adapter/ on the
            # task's model, so the task's keys that need them (task=dpo's reference=base) hold; its merged
            # weights predict alike. Without adapters in the config, merged weights are a plain model.
            adapted = cfg.adapter.kind is not AdapterKind.none
            adapter = saved_adapter(source, adapted)
            if adapter is not None:
                log.info("evaluating the adapters of %s on the task's model", adapter)
            elif adapted:
                log.info("%s holds the adapters merged into its weights: evaluating them as the plain model", source)
                cfg = dataclasses.replace(cfg, adapter=AdapterConfig())
            components = build_components(cfg, accelerator, saved_adapter=adapter)
            components.weight_average = None
            if adapter is None:
                accelerator.load_model(components.model, source)
            log.info("evaluating %s", describe_export(source, run_folder=given if source != given else None))
        else:
            components = build_components(cfg, accelerator)
            # The checkpoint's own layout (weights, optimizer, weight average...), read only.
            policy = CheckpointPolicy(cfg, components, LoopState(), build_early_stopping(cfg), run_dir)
            manifest = accelerator.load_state(source, config_hash=policy.config_hash)
            newest = "" if Path(manifest.folder) == source else f", the newest in {source}"
            source = Path(manifest.folder)
            log.info("evaluating checkpoint %s (step %s, epoch %s%s)", manifest.folder, manifest.step, manifest.epoch,
                     newest)
        metrics = evaluate(components)
        log.info("evaluated %s: %s", source, human_metrics(metrics, prefix="eval/"))
        if accelerator.is_main_process:
            (run_dir / EVAL_METRICS_FILE).write_text(
                json.dumps({"source": str(source.resolve()), "metrics": metrics}, indent=1) + "\n", encoding="utf-8")
        if cfg.predicts_test:
            # The same weights (and pair orders) as the evaluation, as a training run predicts after its export.
            write_test_predictions(components, run_dir / PREDICTIONS_FILE)
        return float(metrics.get(cfg.early_stopping.monitor, float("nan")))
    finally:
        accelerator.end_training()


def describe_export(model_folder: Path, run_folder: Path | None) -> str:
    """e.g. ``the run's exported model outputs/x/model (best weights, step 10, eval/accuracy = 0.97);
    resume=outputs/x/checkpoints/checkpoint_<N> evaluates a checkpoint instead``."""
    described = export_description(model_folder)
    facts = []
    if described.get("exported"):
        facts.append(f"{described['exported']} weights")
    if described.get("step") is not None:
        facts.append(f"step {described['step']}")
    metric = described.get("metric") or {}
    if metric.get("name") and metric.get("value") is not None:
        facts.append(f"{metric['name']} = {human(metric['value'])}")
    said = f"the run's exported model {model_folder}" if run_folder is not None else f"the model {model_folder}"
    if facts:
        said += f" ({', '.join(facts)})"
    if run_folder is not None:
        said += f"; resume={checkpoints_dir(run_folder)}/checkpoint_<N> evaluates a checkpoint instead"
    return said
