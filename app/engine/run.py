"""One training run, from a validated config and a run folder to the monitored metric."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from app.config import ConfigError, RunConfig
from app.distributed.random import set_seed
from app.engine.build import build_accelerator, build_components, build_early_stopping, plain
from app.engine.checkpoint import CheckpointPolicy, export_model, preserved_rng, tracker_kwargs
from app.engine.loop import NON_FINITE_LOSS, LoopState, fit
from app.engine.predict import PREDICTIONS_FILE, write_test_predictions
from app.engine.progress import human
from app.engine.result import FAILED, FINISHED, INTERRUPTED, NAN, RESULT_FILE, objective, write_result
from app.engine.summary import model_summary

log = logging.getLogger(__name__)


def run(cfg: RunConfig, run_dir: Path) -> float:
    """Train and evaluate; returns the best value of ``early_stopping.monitor`` (the objective of a
    sweep), or NaN when the run stopped on a non-finite loss. ``result.json`` records how it ended."""
    started = time.monotonic()
    set_seed(cfg.seed)
    accelerator = build_accelerator(cfg, run_dir)
    if not accelerator.is_main_process:
        # Logs and progress appear once, from the main process.
        logging.getLogger().setLevel(logging.WARNING)
    stopper = build_early_stopping(cfg)
    state = LoopState()

    def record(status: str, **extra: object) -> None:
        if accelerator.is_main_process:
            write_result(run_dir, status=status, monitor=stopper.monitor, mode=stopper.mode, best=stopper.best,
                         objective=objective(stopper.best, status), steps=state.global_step,
                         stop_reason=state.stop_reason, wall_time_s=round(time.monotonic() - started, 3), **extra)

    try:
        components = build_components(cfg, accelerator)
        checkpoints = CheckpointPolicy(cfg, components, state, stopper, run_dir)
        resumed = checkpoints.resume(cfg.resume)
        if accelerator.is_main_process:
            # An earlier segment's result no longer describes the folder once training goes on (a
            # refused resume, above, leaves the folder as it was).
            (run_dir / RESULT_FILE).unlink(missing_ok=True)
        with preserved_rng(accelerator.backend):
            accelerator.init_trackers(cfg.logging.project_name, config=plain(cfg),
                                      init_kwargs=tracker_kwargs(resumed, cfg.logging.group))
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
        status = NAN if (state.stop_reason or "").startswith(NON_FINITE_LOSS) else FINISHED
        record(status)
        return objective(stopper.best, status)
    except ConfigError:
        raise  # refused input, reported as such: the run never started
    except Exception as err:
        record(FAILED, error=f"{type(err).__name__}: {err}")
        raise
    except BaseException:  # KeyboardInterrupt, SystemExit from a signal handler
        record(INTERRUPTED)
        raise
    finally:
        accelerator.end_training()
