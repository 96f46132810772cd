"""The life-cycle of checkpoint folders: numbering, atomic commit, verification, choice, rotation.

Layout: ``<run folder>/checkpoints/checkpoint_<N>/`` with ``manifest.json`` written last. A folder
*is* a checkpoint only when its manifest parses (listing, numbering, rotation) and, to be resumed
from, when every file it lists has the recorded size and SHA-256 (:func:`verify`). Anything else
in ``checkpoints/`` (stray names, half-written folders) is ignored: never chosen, never deleted.

A checkpoint is written into ``checkpoints/.tmp-checkpoint_<N>-<random>/``, its files fsynced, the
manifest written and fsynced, then the folder is renamed into place and the parent fsynced. A
crash at any point leaves either the previous set of checkpoints or the new one complete, plus at
most a ``.tmp-*`` folder that :func:`clean_temporaries` removes later. Rotation runs only after
that, on the main process, and moves a folder out of the way (rename) before deleting it.

Only the standard library is used here (file hashing imports ``checkpoint_format`` lazily).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.config import ConfigError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "app-checkpoint/1"
CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"checkpoint_(\d+)")
_TEMP_PREFIX = ".tmp-checkpoint_"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, incomplete, tampered with, or for another model."""


@dataclass
class Manifest:
    """What ``manifest.json`` records. ``files`` maps each file (relative path) to its size and
    SHA-256; ``metric`` is the monitored evaluation value at this step, if one was measured."""

    save_number: int
    step: int = 0
    epoch: int = 0
    world_size: int = 1
    config_hash: str | None = None
    metric: dict[str, Any] | None = None
    """{"name": ..., "value": ..., "mode": "max"|"min"}: keep_best uses it."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    """Whatever the caller adds (the engine: global batch size, metrics.jsonl size)."""
    created: str = ""
    format: str = FORMAT
    folder: str = field(default="", compare=False)
    """Where this manifest was read from (not stored)."""

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "folder"}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not an app checkpoint manifest")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "folder"}
        manifest = cls(**known)
        if not isinstance(manifest.save_number, int) or not isinstance(manifest.files, dict):
            raise ValueError("malformed manifest")  # noqa: TRY004 - read_manifest treats ValueError as "not ours"
        return manifest

    def metric_value(self) -> float | None:
        value = (self.metric or {}).get("value")
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest, or None when it has none or it does not parse (never raises)."""
    try:
        manifest = Manifest.from_json((folder / MANIFEST).read_text())
    except (OSError, ValueError, TypeError):
        return None
    manifest.folder = str(folder)
    return manifest


def verify(folder: Path) -> str | None:
    """None when ``folder`` is a complete, intact checkpoint; else what is wrong, as a phrase.

    Hashing reads every byte (what resuming needs); sizes catch truncation cheaply first.
    """
    from app.distributed.checkpoint_format import sha256_file

    manifest = read_manifest(folder)
    if manifest is None:
        return "it has no readable manifest.json (an interrupted save?)"
    for name, digest in manifest.files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != digest.get("size"):
            return f"{name} has {path.stat().st_size} bytes instead of {digest.get('size')} (truncated?)"
    for name, digest in manifest.files.items():
        if sha256_file(folder / name) != digest.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest (modified or corrupted)"
    return None


def quick_check(folder: Path) -> str | None:
    """Like :func:`verify` but without hashing: manifest present, files present with their sizes."""
    manifest = read_manifest(folder)
    if manifest is None:
        return "it has no readable manifest.json (an interrupted save?)"
    for name, digest in manifest.files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != digest.get("size"):
            return f"{name} is missing or truncated"
    return None


def complete_checkpoints(root: Path) -> list[tuple[Path, Manifest]]:
    """``checkpoint_<N>`` folders whose manifest parses and names them, oldest save first."""
    found = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if not match or not entry.is_dir():
            continue
        manifest = read_manifest(entry)
        if manifest is not None and manifest.save_number == int(match.group(1)):
            found.append((entry, manifest))
    return sorted(found, key=lambda item: item[1].save_number)


def next_save_number(root: Path) -> int:
    """One more than any save recorded in a manifest, and than any ``checkpoint_<N>`` name already
    taken (so numbering continues across resumes and never lands on an existing folder)."""
    numbers = [m.save_number for _, m in complete_checkpoints(root)]
    try:
        numbers += [int(m.group(1)) for e in root.iterdir() if (m := _NAME.fullmatch(e.name))]
    except OSError:
        pass
    return max(numbers, default=-1) + 1


def temporary_folder(root: Path, save_number: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{_TEMP_PREFIX}{save_number}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def commit(temporary: Path, final: Path, manifest: Manifest) -> Path:
    """Write the manifest (last; the files it lists must already be fsynced), make it durable, and
    rename the folder into place.

    An existing ``final`` (an explicit ``save_state(dir)`` called twice) is replaced: moved aside
    first, deleted only after the new folder is in place.
    """
    from app.distributed.checkpoint_format import fsync_path, write_bytes

    manifest.created = manifest.created or time.strftime("%Y-%m-%dT%H:%M:%S%z")
    fault_point("before-manifest", manifest.save_number)
    write_bytes(temporary / MANIFEST, manifest.to_json().encode())
    fsync_path(temporary / MANIFEST)
    fsync_path(temporary)
    fault_point("before-rename", manifest.save_number)
    replace_folder(temporary, final)
    return final


def replace_folder(temporary: Path, final: Path) -> None:
    """Rename a fully written folder to ``final``. Something already there is moved aside first
    (named after the temporary folder, so :func:`clean_temporaries` finds it after a crash) and
    deleted only once the new folder is in place."""
    from app.distributed.checkpoint_format import fsync_path

    old = None
    if final.exists():
        old = temporary.with_name(temporary.name + "-old")
        os.rename(final, old)
    os.rename(temporary, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_temporaries(root: Path) -> None:
    """Remove ``.tmp-checkpoint_*`` folders left by a crash. Only our own names, and only while no
    save of this run is in progress (saves are sequential, on the main process)."""
    try:
        leftovers = [e for e in root.iterdir() if e.name.startswith(_TEMP_PREFIX) and e.is_dir()]
    except OSError:
        return
    for path in leftovers:
        log.info("removing %s, left by an interrupted save", path)
        shutil.rmtree(path, ignore_errors=True)


def best_checkpoint(checkpoints: list[tuple[Path, Manifest]]) -> Path | None:
    """The checkpoint with the best recorded metric (the newest among equals)."""
    best: tuple[Path, float] | None = None
    for path, manifest in checkpoints:
        value = manifest.metric_value()
        if value is None:
            continue
        sign = -1.0 if (manifest.metric or {}).get("mode") == "min" else 1.0
        if best is None or sign * value >= sign * best[1]:
            best = (path, value)
    return best[0] if best else None


def rotate(root: Path, total_limit: int | None, keep_best: bool, newest: Path) -> list[Path]:
    """Delete complete checkpoints beyond the ``total_limit`` newest, never ``newest`` (the one just
    written) nor, with ``keep_best``, the best one. Returns what was deleted."""
    if total_limit is None:
        return []
    checkpoints = complete_checkpoints(root)
    keep = {path for path, _ in checkpoints[-total_limit:]} | {newest}
    if keep_best and (best := best_checkpoint(checkpoints)) is not None:
        keep.add(best)
    removed = []
    for path, _ in checkpoints:
        if path in keep:
            continue
        # Renamed first: a crash mid-delete leaves a .tmp-* folder, never a half-deleted checkpoint.
        doomed = root / f"{_TEMP_PREFIX}rotated-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


# -- choosing what to resume from --------------------------------------------------------------------


def checkpoints_root(path: Path) -> Path | None:
    """The ``checkpoints/`` folder meant by a run folder or a checkpoints folder, else None."""
    if (path / CHECKPOINTS).is_dir():
        return path / CHECKPOINTS
    if path.is_dir() and (path.name == CHECKPOINTS or any(_NAME.fullmatch(e.name) for e in path.iterdir())):
        return path
    return None


def is_checkpoint_folder(path: Path) -> bool:
    return (path / MANIFEST).exists() or bool(_NAME.fullmatch(path.name))


def find_checkpoint(path: Path, deep: bool = True) -> Path:
    """The checkpoint to resume from for ``resume=<path>`` (a run folder, its ``checkpoints/``, or one
    checkpoint). In a folder of checkpoints it is the newest that verifies; a newer one that does not
    is skipped with a warning naming it. Raises CheckpointError (one sentence) when there is none.

    ``deep=False`` checks sizes only (no hashing), for a quick look before the run starts.
    """
    check = verify if deep else quick_check
    if not path.exists():
        raise CheckpointError(f"resume={path} does not exist.")
    if is_checkpoint_folder(path):
        problem = check(path)
        if problem:
            raise CheckpointError(f"cannot resume from {path}: {problem}.")
        return path
    root = checkpoints_root(path)
    candidates = complete_checkpoints(root) if root is not None else []
    if not candidates:
        raise CheckpointError(f"resume={path} contains no checkpoint (expected checkpoints/checkpoint_<N>/manifest.json).")
    rejected = []
    for folder, _ in reversed(candidates):
        problem = check(folder)
        if problem is None:
            return folder
        log.warning("skipping checkpoint %s: %s", folder, problem)
        rejected.append(f"{folder.name} ({problem})")
    raise CheckpointError(f"no checkpoint in {root} verifies: {'; '.join(rejected)}.")


def run_folder_of(checkpoint: Path) -> Path:
    """The run folder a checkpoint belongs to (``<run>/checkpoints/checkpoint_<N>``)."""
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else checkpoint.parent


# -- fault injection (tests only) --------------------------------------------------------------------

FAULT_ENV = "APP_CHECKPOINT_FAULT"
"""Fault-injection point for the crash tests: ``APP_CHECKPOINT_FAULT=<point>:<save number>`` makes the
process SIGKILL itself at ``<point>`` of that save, where point is ``files`` (half the files
written), ``before-manifest``, ``before-rename`` or ``before-rotate``. Unset in normal use."""


def fault_point(point: str, save_number: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    wanted, _, number = spec.partition(":")
    if wanted == point and (not number or save_number == int(number)):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)

