"""The command line before Hydra sees it: one ordered pipeline of named rewrites (:data:`STEPS`), each a
function from the arguments (without the program) to the arguments to go on with. In order:

1. :func:`config_dir_as_searchpath`: ``--config-dir DIR`` becomes the override
   ``hydra.searchpath=[file://DIR]`` (first, so that the rewrites below, which reorder overrides, keep it);
2. :func:`bare_values_as_lists`: a bare value given to a list key (``adapter.target_modules=all-linear``)
   becomes a list of one (``[all-linear]``);
3. :func:`task_keys_of_a_task_sweep`: in a sweep over tasks, ``task.<key>=v`` becomes ``++task.<key>=v``;
4. :func:`argv_for_resume`: ``resume=<path>`` becomes the original run's overrides, the new ones and
   its run folder (a requeued SLURM job gets ``resume=auto``);
5. :func:`slurm_task_as_rank`: no rewrite: a task of an ``srun`` step exports its rank the way torchrun
   would (before the next step, which reads it);
6. :func:`argv_for_rank`: inside torchrun, every rank gets the one run folder rank 0 chose;
7. :func:`claim_from_argv`: a run folder the command line now names is checked and locked before Hydra
   writes into it (last: the steps above name it); a resume into it defers Hydra's ``.hydra/`` record.

A step refuses bad input by raising :class:`~app.config.ConfigError` (one sentence, exit 2) before any
folder is created. Everything else (composing, type-checking, the run folder Hydra picks) is Hydra's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from app import this_process
from app.cli.configure import CONF_DIR, list_keys
from app.config import ConfigError
from app.engine.checkpoint_resume import exported_model_of, is_model_folder
from app.launching.overrides import override_key, quote, unquote
from app.launching.slurm import adopt_slurm_layout, requeued
from app.run_folder.claims import CLAIMS, claim_new_run
from app.run_folder.layout import HYDRA_DIR
from app.run_folder.record import original_overrides, recorded_searchpath
from app.this_process import is_multirun

Rewrite = Callable[[list[str]], list[str]]


def rewrite(argv: list[str]) -> list[str]:
    """``argv`` through every step of :data:`STEPS`, in order."""
    for step in STEPS:
        argv = step(argv)
    return argv


# -- 1. --config-dir -------------------------------------------------------------------------------------------
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
    paths = ",".join(quote(f"file://{Path(folder).expanduser().resolve()}") for folder in folders)
    return [*out, f"hydra.searchpath=[{paths}]"]


# -- 2. a list given one value --------------------------------------------------------------------------------
_NOT_A_BARE_VALUE = ("[", "null", "None", "${")
_SWEEP_FUNCTIONS = ("choice(", "range(", "interval(", "glob(", "sort(", "shuffle(", "tag(")


def bare_values_as_lists(argv: list[str]) -> list[str]:
    """A bare value given to a key whose value is a list (``adapter.target_modules=all-linear``,
    ``logging.trackers=wandb``) as a list of that one value (``[all-linear]``), which is what peft's and
    the other tools' own option means; Hydra would refuse the string for a list. A list, null, an
    interpolation, and in a sweep a comma or a sweep function, are left as they are."""
    keys = list_keys()
    multirun = is_multirun(argv)
    out = []
    for arg in argv:
        key = override_key(arg)
        if key in keys and "=" in arg and not arg.startswith("~"):
            name, value = arg.split("=", 1)
            sweep = multirun and ("," in value or value.startswith(_SWEEP_FUNCTIONS))
            if value.strip() and not value.startswith(_NOT_A_BARE_VALUE) and not sweep:
                arg = f"{name}=[{value}]"
        out.append(arg)
    return out


# -- 3. a sweep over tasks --------------------------------------------------------------------------------------
def task_keys_of_a_task_sweep(argv: list[str]) -> list[str]:
    """In a sweep over tasks (``-m task=glue_cola,glue_rte``), ``task.<key>=value`` as
    ``++task.<key>=value``. Hydra first composes a multirun's config with the default of each swept
    group (task=digits), where a key of the swept tasks (``task.data_dir``) does not exist and would
    stop the sweep before its first job; ``++`` sets it wherever it exists, and each job's own config
    is still checked key by key (``app.cli.job.unknown_keys``)."""
    if not is_multirun(argv):
        return argv
    sweeps_tasks = any(arg.startswith("task=") and ("," in arg or "(" in arg) for arg in argv)
    if not sweeps_tasks:
        return argv
    return [f"++{arg}" if arg.startswith("task.") and "=" in arg else arg for arg in argv]


# -- 4. resume= --------------------------------------------------------------------------------------------------
def argv_for_resume(argv: list[str]) -> list[str]:
    """``resume=<path>``: continue the original run folder, before Hydra creates a new one. When the path
    names a checkpoint, a ``checkpoints/`` folder or a run folder, the arguments become: the original run's
    overrides (from its ``.hydra/overrides.yaml``, minus any key given again now and the keys inside a
    group chosen again), then the new ones (which win), then ``hydra.run.dir=<original run folder>``. The
    resumed run so logs into the same folder, continues the checkpoint numbering and the same TensorBoard
    run, and trains the same task without retyping it. A run composed with ``--config-dir <dir>`` (a task
    from the user's config folder) is composed with that folder again when the command line names none
    (``hydra.searchpath``, as recorded in ``.hydra/hydra.yaml``).

    With ``mode=eval`` the path may also be an exported ``model/`` folder (a run folder means its
    ``model/``, when it has one), and no ``hydra.run.dir`` is added: the evaluation gets a new run folder.

    A job SLURM started again (requeued: ``SLURM_RESTART_COUNT`` > 0) without ``resume=`` gets
    ``resume=auto``: it continues its run folder's newest valid checkpoint (``app.launching.slurm``).

    Left alone: no ``resume=``, ``resume=auto`` (the run folder is whatever ``hydra.run.dir`` says; pass the
    same ``hydra.run.dir`` as the interrupted run), an explicit ``hydra.run.dir`` when training (resume the
    weights into another folder), and multirun sweeps. A path without a checkpoint fails here, with one
    sentence, before any folder is created; the files are hashed later, by the run itself."""
    overrides = [arg for arg in argv if not arg.startswith("-")]
    given = {override_key(arg) for arg in overrides}
    multirun = is_multirun(argv)
    if "resume" not in given and not multirun and requeued(os.environ):
        # Before the run folder is claimed: a new run would be refused in a folder with checkpoints.
        return [*argv, "resume=auto"]
    resume = [arg.split("=", 1)[1] for arg in overrides if override_key(arg) == "resume" and "=" in arg]
    # mode=eval reads the weights and writes into a new run folder (the trained run stays untouched),
    # wherever hydra.run.dir puts it.
    evaluating = any(override_key(arg) == "mode" and unquote(arg.split("=", 1)[1]) == "eval"
                     for arg in overrides if "=" in arg)
    if not resume or ("hydra.run.dir" in given and not evaluating) or multirun:
        return argv
    value = unquote(resume[-1])
    if value in ("auto", "null", "None", ""):
        return argv
    from app.distributed.checkpoint.store import find_checkpoint, run_folder_of

    if evaluating and is_model_folder(Path(value)):
        run_folder = Path(value).parent
    elif evaluating and exported_model_of(Path(value)) is not None:
        run_folder = Path(value)  # its export is evaluated (app.engine.evaluate_saved), checkpoints or not
    else:
        run_folder = run_folder_of(find_checkpoint(Path(value), deep=False))
    # A group chosen anew (hardware=cpu) starts from that option's defaults: the earlier run's keys
    # inside the group (hardware.num_processes=2) are left behind with its earlier option.
    regrouped = {key for key in given if "." not in key}
    earlier = [arg for arg in original_overrides(run_folder)
               if override_key(arg) not in given and override_key(arg) not in ("resume", "overwrite", "mode")
               and not override_key(arg).startswith("hydra") and override_key(arg).split(".")[0] not in regrouped]
    # Its config folder (--config-dir), unless this command line names one: its task may come from there.
    searchpath = [] if "hydra.searchpath" in given else recorded_searchpath(run_folder)
    config_dir = [f"hydra.searchpath=[{','.join(quote(entry) for entry in searchpath)}]"] if searchpath else []
    return earlier + argv + config_dir + ([] if evaluating else [f"hydra.run.dir={quote(str(run_folder))}"])


# -- 5. a SLURM task -------------------------------------------------------------------------------------------
def slurm_task_as_rank(argv: list[str]) -> list[str]:
    """``srun -n N python -m app ...``: each SLURM task is one rank, its layout exported as torchrun would
    (``app.launching.slurm``); a sweep's command line is left to the sweep's own launcher."""
    if not is_multirun(argv):
        adopt_slurm_layout()
    return argv


# -- 6. torchrun's ranks ---------------------------------------------------------------------------------------
# Hydra settings that ranks other than 0 replace with "write nothing".
_RANK0_ONLY = ("hydra.output_subdir", "hydra/job_logging", "hydra/hydra_logging")
_STORE_TIMEOUT_S = 300.0


class LaunchError(ConfigError):
    """This torchrun launch cannot get one run folder; the message says what to do."""


def argv_for_rank(argv: list[str], conf_dir: Path = CONF_DIR) -> list[str]:
    """One run folder for a job that torchrun started (``torchrun --nproc_per_node=2 -m app ...``): the
    Hydra arguments this rank should run with; ``argv`` unchanged outside torchrun.

    Every rank runs ``python -m app`` and so Hydra; left alone, each would create its own timestamped
    folder (Hydra #2070/#2074). Before Hydra starts, rank 0 works out the folder Hydra would create and
    publishes it in the launcher's key-value store (the c10d TCPStore torchrun already runs); every rank
    then runs Hydra with ``hydra.run.dir=<that folder>``, and ranks other than 0 also with Hydra's output
    (``.hydra/``) and logging switched off, so they write nothing there."""
    world = this_process.launched_world_size()
    if world is None or world < 2:
        return argv
    if is_multirun(argv):
        raise LaunchError(
            "a multirun sweep cannot run inside torchrun; run python -m app -m ... with hardware=multi_cpu "
            "(or multi_gpu/fsdp), which starts the workers of each job itself."
        )
    rank = this_process.rank()
    given = [arg.split("=", 1)[1] for arg in argv if override_key(arg) == "hydra.run.dir"]
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        run_dir = quote(_agree(rank, lambda: _planned_run_dir(argv, conf_dir)), always=True)
    elif given:
        run_dir = given[-1]
    else:
        # Without torchrun's store, rank 0 would have to host one on MASTER_PORT, the port the
        # process group binds next; instead the user names the folder.
        raise LaunchError(
            "outside torchrun's elastic agent, pass hydra.run.dir=<folder> (without ${now:...}) so every "
            "process uses the same run folder."
        )
    argv = [arg for arg in argv if override_key(arg) != "hydra.run.dir"] + [f"hydra.run.dir={run_dir}"]
    if rank == 0:
        return argv
    return [arg for arg in argv if override_key(arg) not in _RANK0_ONLY] + [
        "hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def _agree(rank: int, propose: Callable[[], str]) -> str:
    """Rank 0's proposal, as read by every rank from the launcher's store."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=_STORE_TIMEOUT_S))
    # One key per launch (and per elastic restart), so a restarted job picks a fresh folder.
    key = f"app/run_dir/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        store.set(key, propose())
    return store.get(key).decode()


def _planned_run_dir(argv: list[str], conf_dir: Path) -> str:
    """``hydra.run.dir`` as Hydra would resolve it for these overrides (``${now:...}`` included)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = [arg for arg in argv if not arg.startswith("-")]
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None, job_name="app"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            return str(OmegaConf.select(cfg, "hydra.run.dir"))
    except Exception:  # noqa: BLE001 - Hydra, run next on every rank, reports a bad override itself
        return datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")


# -- 7. the named run folder ---------------------------------------------------------------------------------
def claim_from_argv(argv: list[str]) -> list[str]:
    """When the command line names the run folder (``hydra.run.dir=...``, as a resume and torchrun do),
    check it, lock it, and, when resuming into an existing folder, defer Hydra's ``.hydra/`` record until
    the resume is accepted (``app.run_folder.claims``). Only the job's rank 0 claims, and not for a sweep
    or a command that only prints (``--cfg``, ``--info``)."""
    if is_multirun(argv) or not this_process.is_rank_zero():
        return argv
    if any(arg.split("=", 1)[0] in ("--cfg", "-c", "--info", "-i", "--resolve") for arg in argv):
        return argv  # Hydra only prints: no run, nothing to claim
    run_dir = _value(argv, "hydra.run.dir")
    if run_dir is None or "${" in run_dir:
        return argv
    resume = _value(argv, "resume")
    if resume in ("null", "None", ""):
        resume = None
    overwrite = (_value(argv, "overwrite") or "false").lower() == "true"
    folder = Path(run_dir)
    moved = claim_new_run(folder, resume, overwrite)
    if moved is not None:
        print(f"overwrite=true: moved the earlier run in {folder} to {moved}", flush=True)
    if resume is not None and (folder / HYDRA_DIR).is_dir() and _value(argv, "hydra.output_subdir") is None:
        CLAIMS.deferred_record = True
        return [*argv, "hydra.output_subdir=null"]
    return argv


def _value(argv: list[str], key: str) -> str | None:
    values = [arg.split("=", 1)[1] for arg in argv if override_key(arg) == key and "=" in arg]
    if not values:
        return None
    value = values[-1].strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return value


STEPS: tuple[Rewrite, ...] = (config_dir_as_searchpath, bare_values_as_lists, task_keys_of_a_task_sweep,
                              argv_for_resume, slurm_task_as_rank, argv_for_rank, claim_from_argv)
"""The rewrites, in the order they run (the module docstring says why this order)."""
