"""Hydra's record of a run, ``<run folder>/.hydra/``: what the run was composed from, read back by a
resume (its overrides, its config folders) and by a sweep that continues (which jobs are done), and
written by the run itself when a resume deferred it until the checkpoint was accepted. Torch-free."""

from __future__ import annotations

import os
from pathlib import Path

from app.config import ConfigError
from app.run_folder.layout import HYDRA_DIR, HYDRA_OVERRIDES, HYDRA_SETTINGS, hydra_file


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


def write_hydra_record(run_dir: Path, record: dict[str, str]) -> None:
    """Write the deferred ``.hydra/`` files (name -> YAML text), each atomically."""
    folder = run_dir / HYDRA_DIR
    folder.mkdir(exist_ok=True)
    for name, text in record.items():
        temporary = folder / f".{name}.tmp-{os.getpid()}"
        temporary.write_text(text)
        os.replace(temporary, folder / name)
