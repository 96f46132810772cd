"""``python -m app resume=<path>``: continue the original run folder, before Hydra creates a new one.

Run by ``app.__main__`` on the raw command line. When it names a checkpoint, a ``checkpoints/``
folder or a run folder, the arguments become: the original run's overrides (from its
``.hydra/overrides.yaml``, minus any key given again now and the keys inside a group chosen again),
then the new ones (which win), then
``hydra.run.dir=<original run folder>``. The resumed run so logs into the same folder, continues the
checkpoint numbering and the same TensorBoard run, and trains the same task without retyping it. A run
composed with ``--config-dir <dir>`` (a task from the user's config folder) is composed with that
folder again when the command line names none (``hydra.searchpath``, as recorded in ``.hydra/hydra.yaml``).

With ``mode=eval`` the path may also be an exported ``model/`` folder (a run folder means its
``model/``, when it has one), and no ``hydra.run.dir`` is added: the evaluation gets a new run folder.

A job SLURM started again (requeued: ``SLURM_RESTART_COUNT`` > 0) without ``resume=`` gets
``resume=auto``: it continues its run folder's newest valid checkpoint (``app.launching.slurm``).

Left alone: no ``resume=``, ``resume=auto`` (the run folder is whatever ``hydra.run.dir`` says;
pass the same ``hydra.run.dir`` as the interrupted run), an explicit ``hydra.run.dir`` when training
(resume the weights into another folder), and multirun sweeps. A path without a checkpoint fails here, with one
sentence, before any folder is created; the files are hashed later, by the run itself.
"""

from __future__ import annotations

import os
from pathlib import Path

from app.config import ConfigError
from app.engine.checkpoint_resume import exported_model_of, is_model_folder
from app.launching.overrides import override_key, quote, unquote
from app.launching.slurm import requeued
from app.run_layout import HYDRA_OVERRIDES, HYDRA_SETTINGS, hydra_file


def original_overrides(run_folder: Path) -> list[str]:
    """The task overrides Hydra recorded for the run (empty when it recorded none)."""
    import yaml  # type: ignore[import-untyped]

    path = hydra_file(run_folder, HYDRA_OVERRIDES)
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(item) for item in loaded] if isinstance(loaded, list) else []


def recorded_searchpath(run_folder: Path) -> list[str]:
    """The config folders the run was composed with (``--config-dir``: Hydra's ``hydra.searchpath``), as
    recorded in its ``.hydra/hydra.yaml``; a recorded local folder that is gone is refused in one sentence."""
    import yaml  # type: ignore[import-untyped]

    try:
        settings = yaml.safe_load(hydra_file(run_folder, HYDRA_SETTINGS).read_text())
        searchpath = settings["hydra"]["searchpath"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return []
    folders = [str(entry) for entry in searchpath or []]
    for entry in folders:
        local = Path(entry.removeprefix("file://"))
        if "://" not in entry.replace("file://", "", 1) and not local.is_dir():
            raise ConfigError(f"the run {run_folder} was composed with the config folder {local} (--config-dir), "
                              "which is not there any more; add --config-dir <that folder's new place>.")
    return folders


def argv_for_resume(argv: list[str]) -> list[str]:
    """The Hydra arguments for a ``resume=<path>`` command line (``argv`` without the program)."""
    overrides = [arg for arg in argv if not arg.startswith("-")]
    given = {override_key(arg) for arg in overrides}
    multirun = any(arg in ("-m", "--multirun") for arg in argv)
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
