"""One training run, from a validated config and a run folder to the monitored metric."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config import ConfigError, RunConfig, RunMode, as_plain
from app.distributed import Accelerator
from app.distributed.checkpoint.store import complete_checkpoints
from app.distributed.determinism import deterministic_algorithms
from app.distributed.profiling import ProfileKwargs
from app.distributed.random import set_seed
from app.engine.build import build_accelerator, build_components, build_early_stopping
from app.engine.checkpoint import CheckpointPolicy, export_model, tracker_kwargs
from app.engine.divergence import weights_are_finite
from app.engine.loop import LoopState, fit
from app.engine.mlflow_options import mlflow_kwargs, mlflow_location
from app.engine.model_card import model_card
from app.engine.predict import write_test_predictions
from app.engine.progress import human
from app.engine.pruning import Pruning
from app.engine.result import FAILED, FINISHED, INTERRUPTED, NAN, PRUNED, objective, write_result
from app.engine.summary import model_summary, stopping_summary
from app.engine.triggers import EarlyStopping
from app.interrupts import Interrupted, RunInterrupted, StopSignals
from app.run_folder.layout import (
    MODEL_DIR,
    PREDICTIONS_FILE,
    checkpoints_dir,
    model_dir,
    profile_dir,
    result_file,
)

log = logging.getLogger(__name__)


def profiling(cfg: RunConfig, accelerator: Accelerator, run_dir: Path) -> contextlib.AbstractContextManager[Any]:
    """trainer.profile_steps: torch.profiler over the real loop (one step skipped, one warm-up, then
    the recorded steps), its Chrome trace written to <run folder>/profile/profile_<rank>.json."""
    steps = cfg.trainer.profile_steps
    if not steps:
        return contextlib.nullcontext()
    schedule = {"wait": 1, "warmup": 1, "active": steps, "repeat": 1}
    log.info("profiling optimizer steps 3 to %d; the trace goes to %s", 2 + steps, profile_dir(run_dir))
    return accelerator.profile(ProfileKwargs(schedule_option=schedule, record_shapes=True,
                                             output_trace_dir=str(profile_dir(run_dir))))


PruningFactory = Callable[[RunConfig, Path, bool], Pruning]
"""Builds a run's link to its sweep's pruner from (config, run folder, is main process): lent by the
launching layer (``app.sweeps.trial_pruning.build_pruning``), which knows about sweeps."""


def run(cfg: RunConfig, run_dir: Path, record_config: Callable[[], None] | None = None,
        stop_file: Path | None = None, build_pruning: PruningFactory | None = None) -> float:
    """Train and evaluate; returns the best value of ``early_stopping.monitor`` (the objective of a
    sweep), or NaN when the run stopped on a non-finite loss. ``result.json`` records how it ended;
    a run whose loss or weights stopped being finite exports nothing (status "nan", and the sentence
    saying so as its error).
    ``record_config``: writes the ``.hydra/`` record a resume deferred (``app.run_folder.record``), called
    on the main process once the resume is accepted. ``build_pruning``: a pruned sweep's trial link
    (none: the run is never pruned).

    A first SIGINT/SIGTERM (or the launcher's ``stop_file``) stops training after the current step
    with a checkpoint, then raises :class:`RunInterrupted` (no export). ``mode=eval`` only evaluates
    saved weights (``app.engine.evaluate_saved``)."""
    if cfg.mode is RunMode.eval:
        from app.engine.evaluate_saved import evaluate_saved

        return evaluate_saved(cfg, run_dir)
    if cfg.trainer.deterministic:
        log.info("deterministic algorithms on (trainer.deterministic)")
    with deterministic_algorithms(cfg.trainer.deterministic):
        return train_and_export(cfg, run_dir, record_config, stop_file, build_pruning)


def train_and_export(cfg: RunConfig, run_dir: Path, record_config: Callable[[], None] | None,
                     stop_file: Path | None, build_pruning: PruningFactory | None = None) -> float:
    started = time.monotonic()
    set_seed(cfg.seed)
    accelerator = build_accelerator(cfg, run_dir)
    if not accelerator.is_main_process:
        # Logs and progress appear once, from the main process.
        logging.getLogger().setLevel(logging.WARNING)
    stopper = build_early_stopping(cfg)
    state = LoopState()
    trained = False

    def record(status: str, exported: dict[str, Any] | None = None, **extra: object) -> None:
        if accelerator.is_main_process:
            write_result(run_dir, status=status, monitor=stopper.monitor, mode=stopper.mode, best=stopper.best,
                         best_step=stopper.best_step, objective=objective(stopper.best, status),
                         steps=state.global_step, stop_reason=state.stop_reason, exported=exported,
                         wall_time_s=round(time.monotonic() - started, 3), **extra)

    try:
        components = build_components(cfg, accelerator)
        if build_pruning is not None:  # a pruned sweep's trial
            components.pruning = build_pruning(cfg, run_dir, accelerator.is_main_process)
        checkpoints = CheckpointPolicy(cfg, components, state, stopper, run_dir)
        resumed = checkpoints.resume(cfg.resume)
        if accelerator.is_main_process:
            if record_config is not None:
                record_config()  # only now: a refused resume leaves the folder as it was
            # An earlier segment's result no longer describes the folder once training goes on.
            result_file(run_dir).unlink(missing_ok=True)
        accelerator.init_trackers(cfg.logging.project_name, config=as_plain(cfg),
                                  init_kwargs={**tracker_kwargs(resumed, cfg.logging.group),
                                               **mlflow_kwargs(cfg, run_dir, resumed is not None)})
        if (mlflow_store := mlflow_location(cfg)) is not None:
            log.info("%s", mlflow_store)
        log.info("training %s on %d process(es); %s; run folder %s", cfg.task.name, accelerator.num_processes,
                 model_summary(accelerator.unwrap_model(components.model), cfg.hardware.kind.value,
                               accelerator.device, accelerator.mixed_precision, components.threads),
                 run_dir)
        log.info("%s", stopping_summary(cfg))
        trained = True  # from here on, the run folder has this run's steps
        with StopSignals(stop_file, announce=accelerator.is_main_process) as interrupts, \
                profiling(cfg, accelerator, run_dir) as components.profiler:
            fit(components, cfg, state, stopper, checkpoints, interrupts)
        throughput = components.throughput.summary() if components.throughput is not None else ""
        log.info("stopped: %s; %s%s", state.stop_reason, best_so_far(stopper),
                 f"; throughput {throughput}" if throughput else "")
        if state.stop_signal is not None:
            interrupted = RunInterrupted(state.stop_signal, state.global_step, str(run_dir))
            log.info("%s", interrupted)
            raise interrupted
        if state.non_finite_loss_step is not None or not weights_are_finite(components):
            # Nothing non-finite is exported; app.cli.job turns this result into exit status 1.
            record(NAN, error=diverged(state, run_dir))
            return objective(stopper.best, NAN)
        if cfg.checkpoint.save_final_model or cfg.predicts_test:
            metadata = checkpoints.weights_for_export(cfg.checkpoint.resolved_export())
        if cfg.predicts_test:
            write_test_predictions(components, run_dir / PREDICTIONS_FILE)
        if cfg.checkpoint.save_final_model:
            card = (model_card(cfg, components, run_dir, metadata, time.monotonic() - started)
                    if accelerator.is_main_process else None)
            export_model(components, model_dir(run_dir), metadata, adapter=cfg.adapter, card=card)
            for tracker in accelerator.trackers:  # those that keep files (mlflow) keep the export too
                tracker.log_artifacts(model_dir(run_dir), MODEL_DIR)
        # A pruned trial stopped as on an early stop and exported alike; only its status says pruned.
        status = FINISHED if components.pruning.pruned_at is None else PRUNED
        record(status, exported=exported_model(metadata) if cfg.checkpoint.save_final_model else None)
        return objective(stopper.best, status)
    except ConfigError:
        raise  # refused input, reported as such: the run never started
    except RunInterrupted:
        record(INTERRUPTED)
        raise
    except Interrupted as err:
        # A signal outside the loop (app.interrupts). During setup nothing is written: a resumed
        # run's folder keeps the result of the segment it continues.
        if trained:
            err.stage = f"after training stopped at step {state.global_step}; its checkpoints are kept"
            record(INTERRUPTED)
        raise
    except Exception as err:
        record(FAILED, error=f"{type(err).__name__}: {err}")
        raise
    except BaseException:  # KeyboardInterrupt, SystemExit from a signal handler
        record(INTERRUPTED)
        raise
    finally:
        # What the device runtime did (a compiling one: graphs compiled, CPU fallbacks), however the run ended.
        report = accelerator.runtime_report()
        if report is not None:
            log.info("%s", report)
        accelerator.end_training()


def best_so_far(stopper: EarlyStopping) -> str:
    """``best eval/accuracy = 0.9694 (step 405)``, or that nothing was evaluated yet (a run stopped before
    its first evaluation: an interrupt)."""
    if stopper.best is None:
        return f"no evaluation yet ({stopper.monitor} not measured)"
    return f"best {stopper.monitor} = {human(stopper.best)}" + (
        "" if stopper.best_step is None else f" (step {stopper.best_step})")


def exported_model(metadata: dict[str, Any]) -> dict[str, Any]:
    """result.json's ``exported``: which weights ``model/`` holds, the checkpoint holding them (None:
    none does), their step and their evaluation's metrics (``model/export.json`` says the same)."""
    return {"weights": metadata["exported"], "checkpoint": metadata.get("checkpoint"), "step": metadata["step"],
            "metrics": metadata["metrics"]}


def diverged(state: LoopState, run_dir: Path) -> str:
    """The one-sentence end of a run whose loss or weights stopped being finite (nothing exported)."""
    checkpoints = complete_checkpoints(checkpoints_dir(run_dir))
    where = (f"the last finite checkpoint is {checkpoints[-1][0]} (step {checkpoints[-1][1].step})" if checkpoints
             else "no checkpoint was saved before it")
    when = (f"the training loss was not finite at step {state.non_finite_loss_step}"
            if state.non_finite_loss_step is not None else "the weights are not finite")
    return (f"training diverged: {when}, so no model was exported; {where} "
            "(a lower optim.lr or trainer.max_grad_norm may help).")
