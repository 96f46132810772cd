"""One training run, from a validated config and a run folder to the monitored metric."""

from __future__ import annotations

import logging
from pathlib import Path

from app.config import RunConfig
from app.distributed.random import set_seed
from app.engine.build import build_accelerator, build_components, build_early_stopping, plain
from app.engine.checkpoint import CheckpointPolicy, export_model, preserved_rng, tracker_kwargs
from app.engine.loop import LoopState, fit
from app.engine.predict import PREDICTIONS_FILE, write_test_predictions
from app.engine.progress import human
from app.engine.summary import model_summary

log = logging.getLogger(__name__)


def run(cfg: RunConfig, run_dir: Path) -> float | None:
    """Train and evaluate; returns the best value of ``early_stopping.monitor`` (for sweepers)."""
    set_seed(cfg.seed)
    accelerator = build_accelerator(cfg, run_dir)
    if not accelerator.is_main_process:
        # Logs and progress appear once, from the main process.
        logging.getLogger().setLevel(logging.WARNING)
    try:
        components = build_components(cfg, accelerator)
        stopper = build_early_stopping(cfg)
        state = LoopState()
        checkpoints = CheckpointPolicy(cfg, components, state, stopper, run_dir)
        resumed = checkpoints.resume(cfg.resume)
        with preserved_rng(accelerator.backend):
            accelerator.init_trackers(cfg.logging.project_name, config=plain(cfg), init_kwargs=tracker_kwargs(resumed))
        log.info("training %s; %s; run folder %s", cfg.task.name,
                 model_summary(accelerator.unwrap_model(components.model), cfg.hardware.kind.value,
                               accelerator.num_processes, accelerator.device, accelerator.mixed_precision),
                 run_dir)
        fit(components, cfg, state, stopper, checkpoints)
        log.info("stopped: %s; best %s = %s", state.stop_reason, stopper.monitor, human(stopper.best))
        if getattr(cfg.task, "predict_test", False):
            write_test_predictions(components, run_dir / PREDICTIONS_FILE)
        if cfg.checkpoint.save_final_model:
            export_model(components, run_dir / "model")
        return stopper.best
    finally:
        accelerator.end_training()
