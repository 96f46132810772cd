"""A refused config leaves nothing behind. Hydra creates the run folder, writes ``.hydra/`` and opens
``app.log`` before the app sees the config, and a refusal can come later still, from a rule that needs
the model or the data (``task.reference=base`` on a model without adapters), once the trackers have
opened ``metrics.jsonl`` and ``tensorboard/``. When the app refuses (one sentence, exit 2), this takes
back everything the start wrote: what was in the folder before is listed with each file's size when the
run starts, and on a refusal every file and folder not listed goes, and a listed file that grew (the
``app.log`` of a refused resume) is cut back to its size, byte for byte. A folder this run created goes
whole (with the empty date folders above it, up to the working directory). Torch-free."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from app.run_folder.layout import HYDRA_DIR, HYDRA_FILES, LOCK_FILE, LOG_FILE


@dataclass
class RunFolderUndo:
    folder: Path
    created: bool
    """Nothing in the folder but what Hydra wrote for this run (its record and an empty log)."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Each file the folder held when the run started (relative path -> bytes); folders end with ``/``."""

    @classmethod
    def take(cls, folder: Path) -> RunFolderUndo:
        sizes = _listing(folder)
        created = sizes.get(LOG_FILE, 0) == 0 and _only_hydras(folder)
        return cls(folder, created, {} if created else sizes)

    def restore(self) -> None:
        """Undo what this run's start wrote (call once the refusal is certain)."""
        if self.created:
            for entry in _entries(self.folder):
                _remove(self.folder / entry.name)
            _remove_empty(self.folder)
            return
        now = _listing(self.folder)
        # Deepest first, so a new folder is empty of new files by the time it is removed.
        for name in sorted(now, key=lambda n: n.count("/"), reverse=True):
            path = self.folder / name.rstrip("/")
            if name not in self.sizes:
                _remove(path)
            elif not name.endswith("/") and now[name] > self.sizes[name]:
                with contextlib.suppress(OSError):
                    os.truncate(path, self.sizes[name])


def _listing(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its size, and every folder (``name/``), without following links."""
    listing: dict[str, int] = {}
    pending = [""]
    while pending:
        prefix = pending.pop()
        for entry in _entries(folder / prefix):
            name = f"{prefix}{entry.name}"
            if entry.is_dir(follow_symlinks=False):
                listing[f"{name}/"] = 0
                pending.append(f"{name}/")
            else:
                with contextlib.suppress(OSError):
                    listing[name] = entry.stat(follow_symlinks=False).st_size
    return listing


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError:
        return []


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _only_hydras(folder: Path) -> bool:
    entries = {entry.name: entry for entry in _entries(folder)}
    if not entries:
        return os.path.isdir(folder)
    for name, entry in entries.items():
        if name in (LOG_FILE, LOCK_FILE):
            continue
        if name != HYDRA_DIR or not entry.is_dir(follow_symlinks=False):
            return False
        if not {e.name for e in _entries(Path(entry.path))} <= set(HYDRA_FILES):
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
