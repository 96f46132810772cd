"""Start the job: validate, then run here (one process, or one rank that torchrun started) or in
worker processes started by torch's elastic launcher (``python -m app hardware=multi_cpu``).

The parent process is the only one that ran Hydra: it chose the run folder and wrote ``.hydra/`` and
the log; the workers receive the validated :class:`RunConfig` and that folder. Only rank 0 logs
INFO (to the console and the run's log file); other ranks log warnings and errors.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config import RunConfig
from app.configure import validate
from app.interrupts import RunInterrupted, StopSignals
from app.worker_errors import WorkerFailed, call_blaming_the_cause, worker_failure
from app.worker_watchdog import Watchdog, record_pid

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
"""How long the other workers of a failed run get to exit by themselves before SIGKILL."""
LOG_FORMAT = "[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s"


def launched_world_size() -> int | None:
    """The number of processes when this one was started by torchrun (or another launcher that sets
    RANK and WORLD_SIZE); None for a plain ``python -m app``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def adopt_slurm_layout(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """In a SLURM step of several tasks (and not already under torchrun), export this task's rank and
    master the way torchrun would: each task is one rank of the job (app/slurm.py)."""
    from app.slurm import slurm_layout

    layout = slurm_layout(environ)
    if layout is not None and "RANK" not in environ:
        environ.update(layout)


def launch(cfg: RunConfig, run_dir: Path, hydra_files: dict[str, str] | None = None) -> float | None:
    """Run the job and return rank 0's result (the monitored metric, for sweepers). ``hydra_files``: the
    ``.hydra/`` files to write once a resume is accepted (``app.run_folder``)."""
    from app.slurm import requeued

    adopt_slurm_layout()  # a submitit job does not pass through app.__main__
    if cfg.resume is None and requeued(os.environ):
        log.info("SLURM requeued this job: resume=auto (its newest valid checkpoint, if any)")
        cfg.resume = "auto"
    world = launched_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world or 1))
    validate(cfg, launched=(world, local_world) if world is not None else None)
    if cfg.logging.print_config and int(os.environ.get("RANK", "0")) == 0:
        from app.config_tree import show_config

        show_config(cfg)
    from app.distributed.hardware import hardware_spec
    from app.engine.run import run

    if world is not None:
        # Already one rank of a torchrun job: Hydra ran on every rank with the agreed run folder
        # (app.torchrun); only rank 0 kept Hydra's logging.
        rank = int(os.environ["RANK"])
        if rank != 0:
            configure_worker_logging(rank, log_file=None)
        # torchrun forwards SIGINT/SIGTERM to every rank; an interrupted rank returns (not raises) so
        # that its error file stays empty, then exits 130/143 like a single process.
        from torch.distributed.elastic.multiprocessing.errors import record

        return _reraise(record(call_blaming_the_cause)(_interruptible, run, cfg, run_dir, hydra_files))
    workers = hardware_spec(cfg.hardware.kind).local_workers(cfg.hardware)
    if workers == 0:
        return run(cfg, run_dir, hydra_files)
    with tempfile.TemporaryDirectory(prefix="app-stop-") as stop_dir:
        stop_file = Path(stop_dir) / "signal"
        # Signalled, the launcher tells the workers through the stop file and waits for their
        # checkpoint instead of killing them (torch's launcher would: it is told to leave both signals).
        with StopSignals(stop_file, forward=True, announce=False):
            results = run_on_processes(run_worker, (cfg, str(run_dir), _current_log_file(), hydra_files, str(stop_file)),
                                       nprocs=workers, collective_timeout_s=cfg.hardware.collective_timeout_s,
                                       leave_stop_signals=True)
    return _reraise(results[0])


def run_worker(cfg: RunConfig, run_dir: str, log_file: str | None,
               hydra_files: dict[str, str] | None = None, stop_file: str | None = None) -> Any:
    """Entry point of each worker that ``launch`` starts: set up logging, then run the job."""
    from app.engine.run import run

    configure_worker_logging(int(os.environ["RANK"]), log_file)
    return _interruptible(run, cfg, Path(run_dir), hydra_files, Path(stop_file) if stop_file else None)


def _interruptible(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, returning a RunInterrupted instead of raising it (it is not a failure)."""
    try:
        return fn(*args)
    except RunInterrupted as interrupted:
        return interrupted


def _reraise(result: Any) -> Any:
    if isinstance(result, RunInterrupted):
        raise result
    return result


def configure_worker_logging(rank: int, log_file: str | None) -> None:
    """Rank 0 logs INFO to stdout and the run's log file; the others only warnings, to stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = logging.Formatter(LOG_FORMAT.format(rank=rank))
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)]
    if rank == 0 and log_file is not None:
        handlers.append(logging.FileHandler(log_file, mode="a", encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def _current_log_file() -> str | None:
    """The file Hydra's job logging writes (``<run folder>/app.log``), for the workers to append to."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


def run_on_processes(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int,
                     collective_timeout_s: float | None = None, leave_stop_signals: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes with torch's elastic launcher; returns each
    rank's return value in rank order.

    When a rank raises or dies the launcher stops the others (``max_restarts=0``) and this raises
    :class:`~app.worker_errors.WorkerFailed` naming the failing rank and its error; a rank that hung
    (the others' collectives timed out) is killed :data:`SHUTDOWN_GRACE_S` after the first failure
    and named instead (``app.worker_watchdog``). Used by ``launch``, the tests and the benchmarks.

    ``leave_stop_signals``: SIGINT and SIGTERM stay with the caller's handlers (torch's launcher would
    kill the workers a few seconds after either; ``launch`` lets them finish a checkpoint instead).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The launcher keeps each rank's error file there; nothing else of it outlives the run.
    logs = tempfile.TemporaryDirectory(prefix="app-launch-")
    handled = "SIGHUP,SIGQUIT" if leave_stop_signals else "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    # Older torch reads the variable only; newer sets it from LaunchConfig.signals_to_handle.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = handled
    signals: dict[str, Any] = {"signals_to_handle": handled} if "signals_to_handle" in LaunchConfig.__dataclass_fields__ else {}
    config = LaunchConfig(
        **signals,
        logs_specs=DefaultLogsSpecs(log_dir=logs.name),
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"app-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"localhost:{free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=_start_method(),
        # Survivors of a failed rank get this long to exit after SIGTERM, then SIGKILL (the agent's
        # own stop; the watchdog below bounds the one its process context does with 30 s).
        shutdown_timeout=int(SHUTDOWN_GRACE_S),
    )
    # The launcher's own INFO lines (configs, rendezvous) are noise next to the run's log.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    pid_dir = Path(logs.name) / "pids"
    pid_dir.mkdir()
    watchdog = Watchdog(Path(logs.name), pid_dir, grace_s=SHUTDOWN_GRACE_S)
    watchdog.start()
    try:
        results = elastic_launch(config, _entry)(fn, args, str(pid_dir))
    except ChildFailedError as err:
        failure = worker_failure(err)
        hung = watchdog.hung_ranks_message(collective_timeout_s)
        if hung is not None and any(word in str(failure).lower() for word in ("timed out", "timeout")):
            raise WorkerFailed(hung, failure.traceback) from None
        raise failure from None
    finally:
        watchdog.stop()
        logs.cleanup()
    return [results[rank] for rank in range(nprocs)]


def _start_method() -> str:
    """Workers are forked from a fork server that has imported torch and the engine once (not
    from this process, whose threads and OpenMP state a fork would copy), so a worker starts in a
    fraction of a second instead of re-importing everything; also across the jobs of a sweep.

    Workers see the environment of the moment the server started, plus the launcher's variables.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(["app.engine.run"])
    return "forkserver"


def _entry(fn: Callable[..., Any], args: tuple[Any, ...], pid_dir: str | None = None) -> Any:
    """What each launched process runs. The launcher wraps it in ``record``, which writes an
    exception's traceback to the error file the parent reads (``worker_failure``)."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # As torchrun does: processes sharing a machine must not each use every core.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    record_pid(pid_dir, int(os.environ["RANK"]))
    return call_blaming_the_cause(fn, *args)
