"""Start the job: validate, then run here (one process, or one rank that torchrun started) or in
worker processes started by torch's elastic launcher (``python -m app hardware=multi_cpu``).

The parent process is the only one that ran Hydra: it chose the run folder and wrote ``.hydra/`` and
the log; the workers receive the validated :class:`RunConfig` and that folder. Only rank 0 logs
INFO (to the console and the run's log file); other ranks log warnings and errors.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app import this_process
from app.config import ConfigError, RunConfig
from app.console.logs import configure_worker_logging, current_log_file
from app.console.native_stderr import native_stderr_to_log
from app.interrupts import STOP_SIGNALS, Interrupted, RunInterrupted, StopSignals, interrupt_outside_training
from app.launching.hub_kernels import hub_kernels_off_by_default, keep_hub_kernels_off
from app.launching.slurm import adopt_slurm_layout, requeued, srun_rank
from app.launching.validate import validate
from app.run_folder.record import write_hydra_record
from app.workers.elastic import WorkerFailed, call_blaming_the_cause
from app.workers.processes import run_on_processes, start_worker_server

log = logging.getLogger(__name__)


def launch(cfg: RunConfig, run_dir: Path, hydra_files: dict[str, str] | None = None,
           overrides: Sequence[str] = ()) -> float | None:
    """Run the job and return rank 0's result (the monitored metric, for sweepers). ``hydra_files``: the
    ``.hydra/`` files to write once a resume is accepted (``app.run_folder.record``); ``overrides``: the
    command line's (what the start says of the config, ``app.console.config_tree``).

    Stopped by SLURM's warning signal (a time limit ahead), a SLURM job requeues itself once the run
    has stopped and saved (``app.launching.slurm_requeue``)."""
    from app.launching.slurm_requeue import requeue_after_stop

    try:
        return _launch(cfg, run_dir, hydra_files, overrides)
    except (RunInterrupted, Interrupted) as stopped:
        requeue_after_stop(stopped.signum, run_dir)
        raise


def _launch(cfg: RunConfig, run_dir: Path, hydra_files: dict[str, str] | None,
            overrides: Sequence[str]) -> float | None:
    # The engine writes them through this callable: it knows when, the run folder's code how.
    record_config = functools.partial(write_hydra_record, run_dir, hydra_files) if hydra_files is not None else None
    adopt_slurm_layout()  # a submitit job does not pass through the command line's rewrites (app.cli.argv)
    hub_kernels_off_by_default()  # before the fork server starts: the workers inherit this environment
    if cfg.resume is None and requeued(os.environ):
        log.info("SLURM requeued this job: resume=auto (its newest valid checkpoint, if any)")
        cfg.resume = "auto"
    world = this_process.launched_world_size()
    local_world = this_process.local_world_size(default=world or 1)
    if world is None and cfg.hardware.num_processes > 1:
        start_worker_server()  # imports on another core while this process imports torch to validate
    validate(cfg, launched=(world, local_world) if world is not None else None)
    from app.distributed.hardware import hardware_spec

    spec = hardware_spec(cfg.hardware.kind)
    if not spec.runs_hub_kernels:
        keep_hub_kernels_off(spec.kind)
    if this_process.is_rank_zero():
        from app.console.config_tree import introduce_config

        introduce_config(cfg, overrides)
    if world is not None:
        run = engine_run()
        # Already one rank of a torchrun job: Hydra ran on every rank with the agreed run folder
        # (app.cli.argv's step agree_on_torchrun_run_folder); only rank 0 kept Hydra's logging.
        rank = this_process.rank()
        if rank != 0:
            configure_worker_logging(rank, log_file=None)
        if srun_rank(os.environ):
            # srun started the ranks: no launcher collects their errors, so each says its own.
            return _reraise(_failing_in_one_sentence(rank, _interruptible, run, cfg, run_dir, record_config))
        # torchrun forwards SIGINT/SIGTERM to every rank; an interrupted rank returns (not raises) so
        # that its error file stays empty, then exits 130/143 like a single process.
        from torch.distributed.elastic.multiprocessing.errors import record

        return _reraise(record(call_blaming_the_cause)(_interruptible, run, cfg, run_dir, record_config))
    workers = spec.local_workers(cfg.hardware)
    if workers == 0:
        with native_stderr_to_log(spec.native_notices, current_log_file(), spec.native_source):
            return engine_run()(cfg, run_dir, record_config)
    with tempfile.TemporaryDirectory(prefix="app-stop-") as stop_dir:
        stop_file = Path(stop_dir) / "signal"
        # Signalled, the launcher tells the workers through the stop file and waits for their
        # checkpoint instead of killing them (torch's launcher would: it is told to leave both signals).
        with StopSignals(stop_file, forward=True, announce=False):
            results = run_on_processes(run_worker, (cfg, str(run_dir), current_log_file(), record_config, str(stop_file)),
                                       nprocs=workers, collective_timeout_s=cfg.hardware.collective_timeout_s,
                                       leave_stop_signals=True)
    return _reraise(results[0])


def run_worker(cfg: RunConfig, run_dir: str, log_file: str | None,
               record_config: Callable[[], None] | None = None, stop_file: str | None = None) -> Any:
    """Entry point of each worker that ``launch`` starts: set up logging, then run the job."""
    configure_worker_logging(this_process.rank(), log_file)
    return _interruptible(engine_run(), cfg, Path(run_dir), record_config, Path(stop_file) if stop_file else None)


def engine_run() -> Callable[..., Any]:
    """The engine's ``run`` with what this layer lends it: the link of a pruned sweep's trial to its study."""
    from app.engine.run import run
    from app.sweeps.trial_pruning import build_pruning

    return functools.partial(run, build_pruning=build_pruning)


def _interruptible(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, returning a RunInterrupted or Interrupted instead of raising it (it is not a
    failure); a signal during this rank's setup ends it the same way."""
    interrupt_outside_training()
    try:
        return fn(*args)
    except (RunInterrupted, Interrupted) as interrupted:
        return interrupted


def _failing_in_one_sentence(rank: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; an error (other than refused input) becomes :class:`WorkerFailed` naming this rank,
    after its traceback. A rank whose peer failed first says so too ("Connection closed by peer")."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - reported as this rank's failure, then re-raised
        # srun now stops the job's other tasks (--kill-on-bad-exit); this one finishes saying why.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        traceback.print_exc()
        said = str(err).strip().splitlines()
        raise WorkerFailed(f"rank {rank} failed: {type(err).__name__}" + (f": {said[0]}" if said else "")) from None


def _reraise(result: Any) -> Any:
    if isinstance(result, (RunInterrupted, Interrupted)):
        raise result
    return result
