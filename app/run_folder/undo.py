"""A refused config leaves nothing behind. Hydra creates the run folder, writes ``.hydra/`` and opens
``app.log`` before the app sees the config; when the app then refuses it (one sentence, exit 2), this
takes them back: a folder this run created goes (with the empty date folders above it, up to the
working directory), and a folder that was there before (a refused resume) gets its ``app.log`` back as
it was, byte for byte. Torch-free."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from app.run_folder.layout import HYDRA_DIR, HYDRA_FILES, LOCK_FILE, LOG_FILE


@dataclass
class RunFolderUndo:
    folder: Path
    created: bool
    """Nothing in the folder but what Hydra wrote for this run (its record and an empty log)."""
    log_size: int

    @classmethod
    def take(cls, folder: Path) -> RunFolderUndo:
        log = folder / LOG_FILE
        try:
            size = log.stat().st_size
        except OSError:
            size = 0
        return cls(folder, size == 0 and _only_hydras(folder), size)

    def restore(self) -> None:
        """Undo what this run's start wrote (call once the refusal is certain)."""
        if self.created:
            for file in HYDRA_FILES:
                with contextlib.suppress(OSError):
                    (self.folder / HYDRA_DIR / file).unlink()
            with contextlib.suppress(OSError):
                (self.folder / HYDRA_DIR).rmdir()
            for name in (LOG_FILE, LOCK_FILE):
                with contextlib.suppress(OSError):
                    (self.folder / name).unlink()
            _remove_empty(self.folder)
            return
        with contextlib.suppress(OSError):
            os.truncate(self.folder / LOG_FILE, self.log_size)


def _only_hydras(folder: Path) -> bool:
    try:
        entries = {entry.name: entry for entry in os.scandir(folder)}
    except OSError:
        return False
    for name, entry in entries.items():
        if name in (LOG_FILE, LOCK_FILE):
            continue
        if name != HYDRA_DIR or not entry.is_dir(follow_symlinks=False):
            return False
        if not {e.name for e in os.scandir(entry.path)} <= set(HYDRA_FILES):
            return False
    return True


def _remove_empty(folder: Path) -> None:
    """Remove ``folder`` if empty, then each empty parent below the working directory."""
    here = Path.cwd().resolve()
    current = folder.resolve()
    with contextlib.suppress(OSError):
        current.rmdir()
    for parent in current.parents:
        if parent == here or here not in parent.parents:
            break
        try:
            parent.rmdir()  # only an empty one
        except OSError:
            break
