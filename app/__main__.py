"""Entry point: ``python -m app [overrides]``.

Hydra composes and type-checks the config (a typo key, a wrong type or an unknown option stops here
with Hydra's message); ``OmegaConf.to_object`` turns it into dataclasses once; cross-field rules
run next; then the job runs in this process or, for multi-process hardware, in workers started by
torch's elastic launcher.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app.config import ConfigError, RunConfig, Tracker
from app.configure import limits_as_given, register_configs, to_run_config
from app.console import announce, details_to_log_file, enter_parallel_job, enter_sweep_job, protect_output
from app.hydra_errors import composition_sentence, unknown_key_sentence
from app.interrupts import Interrupted, interrupt_outside_training
from app.library_logs import library_logs_to_log_file
from app.refusal import RunFolderUndo
from app.run_folder import CLAIMS, claim_from_argv
from app.run_layout import HYDRA_CONFIG, HYDRA_OVERRIDES, HYDRA_SETTINGS, mlflow_store

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
log = logging.getLogger("app")

register_configs()


def fail(message: str, exit_code: int = 2) -> NoReturn:
    """One sentence on stderr, once, then a non-zero exit: 2, bad input (``main`` then takes back what
    the run's start wrote), or 1, a run that failed (the sentence also goes to its log file)."""
    if exit_code != 2:
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), None)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> float | None:
    protect_output()  # again: a launcher's job process (joblib's) did not pass through the top of this file
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    # What Hydra has just written (the folder, .hydra/, app.log): taken back if the config is refused.
    undo = RunFolderUndo.take(run_dir) if os.environ.get("RANK", "0") == "0" else None
    try:
        try:
            cfg = to_run_config(dict_cfg)
        except ConfigError as err:
            fail(str(err))
        if unknown := unknown_keys(OmegaConf.to_container(dict_cfg, resolve=False), cfg):
            parent: Any = cfg
            for part in unknown[0].split(".")[:-1]:
                parent = getattr(parent, part)
            fail(unknown_key_sentence(unknown[0], parent, added=True))
        limits_as_given(cfg, list(hydra_cfg.overrides.task))
        with parallel_job_lines(hydra_cfg, run_dir):
            return run_job(cfg, dict_cfg, hydra_cfg, run_dir)
    except SystemExit as end:
        if end.code == 2 and undo is not None:  # refused: nothing of this run stays behind
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.FileHandler):
                    handler.close()
            undo.restore()
        raise


def run_job(cfg: RunConfig, dict_cfg: DictConfig, hydra_cfg: Any, run_dir: Path) -> float | None:
    try:
        cfg.check()  # the groups' own rules (quick, torch-free) first: a config they refuse names no folder
    except ConfigError as err:
        fail(str(err))
    if os.environ.get("RANK", "0") == "0":
        # Said at once: the rest of start-up (imports, data) can take seconds.
        log.info("run folder %s", run_dir)
        details_to_log_file()  # each checkpoint's lines: in app.log, not on the terminal
    library_logs_to_log_file()  # transformers', MLflow's... lines too (app/library_logs.py)
    multirun = hydra_cfg.mode is RunMode.MULTIRUN
    if multirun:
        enter_sweep_job()  # the config tree is printed for the first job only (app.console)
    if multirun and cfg.logging.group is None:
        cfg.logging.group = str(hydra_cfg.sweep.dir)  # wandb shows a sweep's jobs as one group
    if Tracker.mlflow in cfg.logging.trackers and cfg.logging.mlflow_tracking_uri is None:
        # One store for the single runs and the sweeps' jobs alike (Hydra's folders say where).
        cfg.logging.mlflow_tracking_uri = mlflow_store(run_dir, Path(hydra_cfg.run.dir), Path(hydra_cfg.sweep.dir))
    from app.engine.result import NAN, read_result
    from app.interrupts import RunInterrupted
    from app.launching.launch import launch
    from app.worker_processes import WorkerFailed

    try:
        if int(os.environ.get("RANK", "0")) == 0:
            CLAIMS.hold(run_dir)  # already held when the command line named the folder
        result = launch(cfg, run_dir, hydra_record(dict_cfg) if CLAIMS.deferred_record else None)
        ended = read_result(run_dir) or {}
        if ended.get("status") == NAN:
            # A diverged run exported nothing: said once, and not a success (a sweep goes on: the
            # trial is recorded as "nan").
            if not multirun:
                fail(str(ended.get("error") or "training diverged."), exit_code=1)
            log.error("%s", ended.get("error"))
        return result
    except RunInterrupted as err:
        # The checkpoint is saved and the main process logged how to resume: 130 (SIGINT) / 143 (SIGTERM).
        sys.exit(err.exit_code)
    except Interrupted as err:
        exit_interrupted(err)
    except ConfigError as err:
        fail(str(err))
    except WorkerFailed as err:
        # The launcher has already printed the rank's traceback; the last line names rank and error.
        fail(str(err), exit_code=1)
    except (RuntimeError, OSError) as err:
        # Imported here: app.distributed imports torch, which a refused config must not wait for.
        from app.distributed.checkpoint.errors import DISK_FULL_ERRNOS, CheckpointWriteError, DiskFullError

        if isinstance(err, (DiskFullError, CheckpointWriteError)):
            fail(str(err), exit_code=1)
        if not isinstance(err, OSError) or err.errno not in DISK_FULL_ERRNOS:
            raise
        fail(f"no space left on the device while writing {err.filename or run_dir}; free some space and resume.",
             exit_code=1)
    finally:
        CLAIMS.release(run_dir)
    return None


PARALLEL_LAUNCHERS = ("joblib",)
"""Hydra launchers whose jobs run at once in processes that share the terminal (``hydra/launcher=joblib``,
``local_parallel``); submitit's jobs write to files of their own already."""


@contextlib.contextmanager
def parallel_job_lines(hydra_cfg: Any, run_dir: Path) -> Iterator[None]:
    """A job of a parallel launcher keeps its config tree, progress and log to its ``app.log``; the
    shared terminal gets one line when it starts and one when it ends."""
    target = str(OmegaConf.select(hydra_cfg, "launcher._target_", default="") or "")
    if hydra_cfg.mode is not RunMode.MULTIRUN or not any(name in target.lower() for name in PARALLEL_LAUNCHERS):
        yield
        return
    from app.engine.progress import human
    from app.engine.result import read_result

    job = int(hydra_cfg.job.num)
    enter_parallel_job(job)
    announce(f"job {job} started: {' '.join(hydra_cfg.overrides.task)} ({run_dir})")
    started = time.monotonic()
    ended = "ended"
    try:
        yield
    except SystemExit as end:  # fail() has said why on stderr
        ended = f"ended with exit code {end.code}"
        raise
    except BaseException as err:
        ended = f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
        raise
    finally:
        result = read_result(run_dir) or {}
        if ended == "ended" and result.get("status"):
            best = result.get("best")
            ended = str(result["status"]) + (f" ({result.get('monitor')} {human(best)})" if best is not None else "")
        announce(f"job {job} {ended} after {time.monotonic() - started:.0f} s; its log: {run_dir / 'app.log'}")


def unknown_keys(composed: Any, typed: Any, prefix: str = "") -> list[str]:
    """Keys of the composed config that its schema does not have (Hydra's ``+key=value`` adds
    keys past the schema): the first one is refused."""
    if not isinstance(composed, dict) or not dataclasses.is_dataclass(typed):
        return []
    fields = {f.name for f in dataclasses.fields(typed)}
    found = []
    for key, value in composed.items():
        if key == "_target_" and hasattr(typed, key):
            continue  # a user's task config carries its class as an attribute (app/tasks/external.py)
        if key not in fields:
            found.append(f"{prefix}{key}")
        else:
            found += unknown_keys(value, getattr(typed, key), f"{prefix}{key}.")
    return found


def hydra_record(dict_cfg: DictConfig) -> dict[str, str]:
    """The ``.hydra/`` files Hydra would have written (deferred on resume until it is accepted)."""
    hydra_cfg = HydraConfig.get()
    return {HYDRA_CONFIG: OmegaConf.to_yaml(dict_cfg),
            HYDRA_SETTINGS: OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})),
            HYDRA_OVERRIDES: OmegaConf.to_yaml(hydra_cfg.overrides.task)}


def exit_interrupted(err: Interrupted) -> NoReturn:
    """A signal outside the training loop: one sentence (in the run's log too, once there is one),
    then 130 (SIGINT) / 143 (SIGTERM)."""
    if logging.getLogger().handlers:
        log.warning("%s", err)
    else:
        print(err, file=sys.stderr)
    # torch's default (WARNING) for its loggers, which an import cut short leaves unset: its exit
    # hooks would log cache statistics at INFO after the sentence.
    logging.getLogger("torch").setLevel(logging.WARNING)
    sys.exit(err.exit_code)


def cli() -> None:
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        from app.help import app_help, chosen_options

        print(app_help(CONF_DIR, chosen_options(sys.argv[1:], CONF_DIR)), end="")
        sys.exit(0)
    from app.launching.launch import adopt_slurm_layout
    from app.launching.resume_argv import argv_for_resume
    from app.launching.torchrun import LaunchError, argv_for_rank

    sys.argv[1:] = task_keys_of_a_task_sweep(config_dir_as_searchpath(sys.argv[1:]))
    try:
        # resume=<path> continues in the original run folder: decided before Hydra creates a new one.
        sys.argv[1:] = argv_for_resume(sys.argv[1:])
    except ConfigError as err:
        fail(str(err))
    if not any(arg in ("-m", "--multirun") for arg in sys.argv[1:]):
        adopt_slurm_layout()  # srun -n N python -m app ...: each SLURM task is one rank
    try:
        # Inside torchrun, every rank must agree on one run folder before Hydra creates any.
        sys.argv[1:] = argv_for_rank(sys.argv[1:], CONF_DIR)
    except LaunchError as err:
        fail(str(err))
    named = [arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith("hydra.run.dir=")]
    new_folder = Path(named[-1].strip("'\"")) if named and not Path(named[-1].strip("'\"")).exists() else None
    try:
        # A named run folder is checked and locked before Hydra writes anything into it.
        sys.argv[1:] = claim_from_argv(sys.argv[1:])
    except ConfigError as err:
        fail(str(err))
    from hydra.errors import CompactHydraException, ConfigCompositionException, OverrideParseException

    # Hydra's composition errors reach us instead of being printed by Hydra (with the schemas among
    # the options, and a "+key" hint for a key the app then refuses): said here in one sentence.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except (ConfigCompositionException, OverrideParseException) as err:
        CLAIMS.release_all()
        if new_folder is not None:
            with contextlib.suppress(OSError):
                new_folder.rmdir()  # made for the claim above, still empty: refused, nothing stays
        fail(composition_sentence(err) if isinstance(err, ConfigCompositionException) else
             f"cannot read the override {err.override}: {str(err.message).splitlines()[0].rstrip('.')}.")
    except CompactHydraException as err:
        # A launcher's one sentence for a failed job (hydra/launcher=slurm): said as ours are, exit 1.
        CLAIMS.release_all()
        fail(str(err), exit_code=1)
    finally:
        CLAIMS.release_all()  # also when Hydra itself refuses the config


def config_dir_as_searchpath(argv: list[str]) -> list[str]:
    """``--config-dir DIR`` (``-cd DIR``, ``--config-dir=DIR``) as the override
    ``hydra.searchpath=[file://<DIR, absolute>]``, which Hydra reads the same way (the folder's groups,
    e.g. ``task/my_task.yaml``, join ours). As an override it survives the command-line rewrites before
    Hydra (resume=, torchrun's ranks), which place the earlier run's overrides first: Hydra's argument
    parser takes the overrides only before or only after an option, not on both sides of it."""
    out: list[str] = []
    folders: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in ("--config-dir", "-cd"):
            folders.append(next(args, ""))
        elif arg.startswith("--config-dir="):
            folders.append(arg.split("=", 1)[1])
        else:
            out.append(arg)
    if not folders or any(arg.lstrip("+").startswith("hydra.searchpath=") for arg in out):
        return argv  # none, or the user also sets the search path: Hydra combines them itself
    from app.launching.overrides import quote

    paths = ",".join(quote(f"file://{Path(folder).expanduser().resolve()}") for folder in folders)
    return [*out, f"hydra.searchpath=[{paths}]"]


def task_keys_of_a_task_sweep(argv: list[str]) -> list[str]:
    """In a sweep over tasks (``-m task=glue_cola,glue_rte``), ``task.<key>=value`` as
    ``++task.<key>=value``. Hydra first composes a multirun's config with the default of each swept
    group (task=digits), where a key of the swept tasks (``task.data_dir``) does not exist and would
    stop the sweep before its first job; ``++`` sets it wherever it exists, and each job's own config
    is still checked key by key (``unknown_keys``)."""
    if not any(arg in ("-m", "--multirun") for arg in argv):
        return argv
    sweeps_tasks = any(arg.startswith("task=") and ("," in arg or "(" in arg) for arg in argv)
    if not sweeps_tasks:
        return argv
    return [f"++{arg}" if arg.startswith("task.") and "=" in arg else arg for arg in argv]


def exit_without_teardown(code: int | str | None) -> NoReturn:
    """End the process as ``sys.exit(code)`` would, minus the interpreter's teardown, which with torch
    loaded takes about a second (collecting every module's objects, then torch's C++ static
    destructors) and only frees memory the exit frees anyway. What Python does before that teardown
    is done here, by the same calls: threading's exit hooks and the join of non-daemon threads
    (executors of joblib/concurrent.futures stop there), the atexit handlers (logging closes its
    files, trackers and the fork server end), the flush of the output."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    protect_output()  # before anything writes: a pipe closed by Ctrl-C (| tee) drops output, never the run
    interrupt_outside_training()  # from the first moment: Ctrl-C during start-up is no traceback
    try:
        try:
            cli()
        except Interrupted as err:
            exit_interrupted(err)
    except SystemExit as end:  # fail(), an interrupt, Hydra's own errors
        exit_without_teardown(end.code)
    exit_without_teardown(0)  # an uncaught exception instead ends the usual way, with its traceback
