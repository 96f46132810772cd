"""The job, from the command line to the launch: the command line's rewrites (``app.cli.argv``), then
Hydra, which composes and type-checks the config (a typo key, a wrong type or an unknown option stops
here, in one sentence: ``app.cli.hydra_errors``); ``OmegaConf.to_object`` turns it into dataclasses
once; the groups' own rules run next; then the job runs in this process or, for multi-process
hardware, in workers started by torch's elastic launcher (``app.launching.launch``).

Every refusal ends in one sentence on stderr and exit 2, and takes back what the run's start wrote
(``app.run_folder.undo``); a run that failed, in one sentence and exit 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app import this_process
from app.cli import argv
from app.cli.configure import CONF_DIR, limits_as_given, register_configs, to_run_config
from app.cli.exits import exit_interrupted, fail
from app.cli.hydra_errors import composition_sentence, unknown_key_sentence
from app.config import ConfigError, InputError, RunConfig, Tracker
from app.console.logs import (
    close_log_files,
    details_to_log_file,
    enter_parallel_job,
    library_logs_to_log_file,
)
from app.console.output import announce, enter_sweep_job, protect_output
from app.interrupts import Interrupted, RunInterrupted
from app.launching.overrides import override_key
from app.run_folder.claims import CLAIMS
from app.run_folder.layout import HYDRA_CONFIG, HYDRA_OVERRIDES, HYDRA_SETTINGS, log_file, mlflow_store
from app.run_folder.undo import RunFolderUndo

log = logging.getLogger("app")

register_configs()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> float | None:
    protect_output()  # again: a launcher's job process (joblib's) did not pass through the top of this file
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    # What Hydra has just written (the folder, .hydra/, app.log): taken back if the config is refused.
    undo = RunFolderUndo.take(run_dir) if this_process.is_rank_zero() else None
    try:
        try:
            cfg = to_run_config(dict_cfg)
        except ConfigError as err:
            fail(str(err))
        if unknown := unknown_keys(OmegaConf.to_container(dict_cfg, resolve=False), cfg):
            parent: Any = cfg
            for part in unknown[0].split(".")[:-1]:
                parent = getattr(parent, part)
            fail(unknown_key_sentence(unknown[0], parent, added=True, **command_choices(list(hydra_cfg.overrides.task))))
        limits_as_given(cfg, list(hydra_cfg.overrides.task))
        with parallel_job_lines(hydra_cfg, run_dir):
            return run_job(cfg, dict_cfg, hydra_cfg, run_dir)
    except SystemExit as end:
        if end.code == 2 and undo is not None:  # refused: nothing of this run stays behind
            close_log_files()
            undo.restore()
        raise


def run_job(cfg: RunConfig, dict_cfg: DictConfig, hydra_cfg: Any, run_dir: Path) -> float | None:
    try:
        cfg.check()  # the groups' own rules (quick, torch-free) first: a config they refuse names no folder
    except ConfigError as err:
        fail(str(err))
    if this_process.is_rank_zero():
        # Said at once: the rest of start-up (imports, data) can take seconds.
        log.info("run folder %s", run_dir)
        details_to_log_file()  # each checkpoint's lines: in app.log, not on the terminal
    library_logs_to_log_file()  # transformers', MLflow's... lines too (app/console/logs.py)
    multirun = hydra_cfg.mode is RunMode.MULTIRUN
    if multirun:
        enter_sweep_job()  # the config tree is printed for the first job only (app.console.output)
    if multirun and cfg.logging.group is None:
        cfg.logging.group = str(hydra_cfg.sweep.dir)  # wandb shows a sweep's jobs as one group
    if Tracker.mlflow in cfg.logging.trackers and cfg.logging.mlflow_tracking_uri is None:
        # One store for the single runs and the sweeps' jobs alike (Hydra's folders say where).
        cfg.logging.mlflow_tracking_uri = mlflow_store(run_dir, Path(hydra_cfg.run.dir), Path(hydra_cfg.sweep.dir))
    from app.engine.result import NAN, read_result
    from app.launching.launch import launch
    from app.workers.elastic import WorkerFailed

    try:
        if this_process.is_rank_zero():
            CLAIMS.hold(run_dir)  # already held when the command line named the folder
        result = launch(cfg, run_dir, hydra_record(dict_cfg) if CLAIMS.deferred_record else None,
                        list(hydra_cfg.overrides.task))
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
    except InputError as err:
        fail(str(err), exit_code=1)
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
        announce(f"job {job} {ended} after {time.monotonic() - started:.0f} s; its log: {log_file(run_dir)}")


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


def command_choices(args: list[str]) -> dict[str, Any]:
    """The ``group=option`` choices (``task=sft``) and ``--config-dir`` folders of a command line after its
    rewrites (a folder is then ``hydra.searchpath=[file://...]``): what composes this run's keys, for the
    unknown-key sentence's ``python -m app ... --cfg job``."""
    from app.cli.help import chosen_options

    chosen = {group: option for group, option in chosen_options(args, CONF_DIR).items() if not group.startswith("hydra")}
    folders = [entry.strip().strip("'\"") for arg in args if override_key(arg) == "hydra.searchpath" and "=" in arg
               for entry in arg.split("=", 1)[1].strip("[]").split(",")]
    return {"chosen": chosen, "config_dirs": tuple(f.removeprefix("file://") for f in folders if f.startswith("file://"))}


def hydra_record(dict_cfg: DictConfig) -> dict[str, str]:
    """The ``.hydra/`` files Hydra would have written (deferred on resume until it is accepted)."""
    hydra_cfg = HydraConfig.get()
    return {HYDRA_CONFIG: OmegaConf.to_yaml(dict_cfg),
            HYDRA_SETTINGS: OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})),
            HYDRA_OVERRIDES: OmegaConf.to_yaml(hydra_cfg.overrides.task)}


def run_command_line() -> None:
    """``python -m app``'s arguments (``sys.argv``), rewritten (:mod:`app.cli.argv`), then given to Hydra."""
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        from app.cli.help import app_help, chosen_options

        print(app_help(CONF_DIR, chosen_options(sys.argv[1:], CONF_DIR)), end="")
        sys.exit(0)
    try:
        sys.argv[1:] = argv.rewrite(sys.argv[1:])
    except ConfigError as err:
        fail(str(err))
    from hydra.errors import CompactHydraException, ConfigCompositionException, OverrideParseException

    # Hydra's composition errors reach us instead of being printed by Hydra (with the schemas among
    # the options, and a "+key" hint for a key the app then refuses): said here in one sentence.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except (ConfigCompositionException, OverrideParseException) as err:
        CLAIMS.abandon()  # a folder made for the command line's claim, still empty: refused, nothing stays
        fail(composition_sentence(err, **command_choices(sys.argv[1:])) if isinstance(err, ConfigCompositionException) else
             f"cannot read the override {err.override}: {str(err.message).splitlines()[0].rstrip('.')}.")
    except CompactHydraException as err:
        # A launcher's one sentence for a failed job (hydra/launcher=slurm): said as ours are, exit 1.
        CLAIMS.release_all()
        fail(str(err), exit_code=1)
    finally:
        CLAIMS.release_all()  # also when Hydra itself refuses the config
