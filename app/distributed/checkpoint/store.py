"""The life-cycle of checkpoint folders: numbering, atomic commit, verification, choice, rotation.

Layout: ``<run folder>/checkpoints/checkpoint_<N>/`` with ``manifest.json`` written last. A folder
*is* a checkpoint only when its manifest parses (listing, numbering, rotation) and, to be resumed
from, when every file it lists is a plain file inside the folder (no ``..``, no absolute path, no
symlink on the way), is well-formed (headers parsed with bounds, see ``format.check_file``)
and has the recorded size and SHA-256 (:func:`verify`). The manifest is the only truth: loading
reads exactly the files it lists, by those names. Anything else in ``checkpoints/`` (stray names,
half-written folders, symlinks) is ignored: never chosen, never deleted.

A checkpoint is written into ``checkpoints/.tmp-checkpoint_<N>-<random>/``, its files fsynced, the
manifest written and fsynced, then the folder is renamed into place and the parent fsynced
(``atomic.publish``). A crash at any point leaves either the previous set of checkpoints or the
new one complete, plus at most a ``.tmp-*`` folder that :func:`clean_temporaries` removes later.
Rotation runs only after that, on the main process, and moves a folder out of the way (rename)
before deleting it.

:func:`read_state` reads a named state of a checkpoint (``scheduler``, ``rng_state_0``...) from the
file its manifest lists.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.distributed.checkpoint.atomic import fsync_path, publish
from app.distributed.checkpoint.errors import CheckpointError, DiskFullError, first_line
from app.distributed.checkpoint.format import check_file, read_state_file, sha256_file, write_bytes
from app.run_folder.layout import CHECKPOINT_PREFIX, CHECKPOINTS_DIR, MANIFEST_FILE

log = logging.getLogger(__name__)

FORMAT = "app-checkpoint/1"
_NAME = re.compile(re.escape(CHECKPOINT_PREFIX) + r"(\d+)")
_TEMP_PREFIX = f".tmp-{CHECKPOINT_PREFIX}"


def disk_full(root: Path, temporary: Path | None, what: str) -> DiskFullError:
    """Remove a save's partial folder and describe the failure: where, and how much it needed
    (a complete checkpoint of this run when there is one, else what was written before it failed)."""
    try:
        block = os.statvfs(root).f_frsize or 4096
    except OSError:
        block = 4096
    written = _bytes_in(temporary, block) if temporary is not None else 0
    if temporary is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    previous = complete_checkpoints(root)
    # What the files take on the device: whole blocks each, plus the folder's own.
    sizes = [int(f.get("size", 0)) for f in previous[-1][1].files.values()] if previous else []
    needed = max(written, block + sum(-(-size // block) * block for size in sizes))
    try:
        free = f", {_size(shutil.disk_usage(root).free)} free"
    except OSError:
        free = ""
    amount = f"about {_size(needed)}" if previous else f"more than {_size(needed)}"
    return DiskFullError(f"no space left on the device of {root} while writing {what}: it needs {amount}{free}; "
                         "earlier checkpoints are intact (free some space, or lower checkpoint.total_limit).")


def _bytes_in(folder: Path, block: int) -> int:
    if not folder.exists():
        return 0
    return block + sum(-(-p.stat().st_size // block) * block for p in folder.rglob("*") if p.is_file())


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


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


MAX_MANIFEST_BYTES = 16 * 2**20
"""A manifest lists file names and digests: anything larger is not one of ours."""


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest, or None when it has none or it does not parse (never raises)."""
    path = folder / MANIFEST_FILE
    try:
        if path.is_symlink() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        manifest = Manifest.from_json(path.read_text())
    except (OSError, ValueError, TypeError, RecursionError):
        return None
    manifest.folder = str(folder)
    return manifest


def listed_files(folder: Path) -> set[str] | None:
    """The file names the folder's manifest lists, or None when it has no readable manifest."""
    manifest = read_manifest(folder)
    return set(manifest.files) if manifest is not None else None


def lists_folder(folder: Path, name: str) -> bool:
    """Whether the folder's manifest lists files under ``name/`` (a backend's sharded state)."""
    return any(file.startswith(f"{name}/") for file in listed_files(folder) or ())


def unsafe_entry(folder: Path, name: str) -> str | None:
    """Why a manifest entry must not be opened (None: it is a plain relative name of a regular
    file inside ``folder``, reached without following a symlink). Checked before anything is read,
    so a tampered manifest cannot make a resume open files elsewhere."""
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or "\x00" in name
            or any(part in ("", ".", "..") for part in parts)):
        return f"its manifest lists {name!r}, which is not a plain relative name inside the checkpoint folder"
    path = folder
    for part in parts:
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return f"{name} is missing"
        if stat.S_ISLNK(mode):
            return f"{name} is or passes through a symlink (symlinks inside checkpoints are refused)"
    if not stat.S_ISREG(mode):
        return f"{name} is not a regular file"
    return None


def _check_listed(folder: Path, manifest: Manifest) -> str | None:
    """Names, types and sizes of the listed files: no file is opened. A subfolder the manifest lists
    files in (FSDP weight shards) must hold nothing else: its reader takes the folder whole."""
    for name, digest in manifest.files.items():
        if problem := unsafe_entry(folder, name):
            return problem
        size = (folder / name).stat().st_size
        if size != digest.get("size"):
            return f"{name} has {size} bytes instead of {digest.get('size')} (truncated?)"
    subfolders = {name.rsplit("/", 1)[0] + "/" for name in manifest.files if "/" in name}
    if extra := [name for name in unlisted_files(folder) if any(name.startswith(sub) for sub in subfolders)]:
        return f"{extra[0]} is in a folder of listed files but not listed itself"
    return None


def verify(folder: Path) -> str | None:
    """None when ``folder`` is a complete, intact checkpoint; else what is wrong, as a phrase.

    Hashing reads every byte (what resuming needs); sizes catch truncation cheaply first.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        return "it has no readable manifest.json (an interrupted save?)"
    if problem := _check_listed(folder, manifest):
        return problem
    for name in manifest.files:
        if problem := check_file(folder / name):
            return f"{name} {problem}"
    for name, digest in manifest.files.items():
        if sha256_file(folder / name) != digest.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest (modified or corrupted)"
    return None


def quick_check(folder: Path) -> str | None:
    """Like :func:`verify` but without hashing: manifest present, files present with their sizes."""
    manifest = read_manifest(folder)
    if manifest is None:
        return "it has no readable manifest.json (an interrupted save?)"
    return _check_listed(folder, manifest)


def unlisted_files(folder: Path) -> list[str]:
    """Files in a checkpoint folder that its manifest does not list (ignored when loading)."""
    listed = listed_files(folder) or set()
    found = []
    for parent, dirs, files in os.walk(folder):  # os.walk does not follow symlinked folders
        for name in files + [d for d in dirs if (Path(parent) / d).is_symlink()]:
            relative = (Path(parent) / name).relative_to(folder).as_posix()
            if relative != MANIFEST_FILE and relative not in listed:
                found.append(relative)
    return sorted(found)


def complete_checkpoints(root: Path) -> list[tuple[Path, Manifest]]:
    """``checkpoint_<N>`` folders whose manifest parses and names them, oldest save first."""
    found = []
    for entry, number in _numbered_entries(root):
        if entry.is_symlink() or not entry.is_dir():
            continue
        manifest = read_manifest(entry)
        if manifest is not None and manifest.save_number == number:
            found.append((entry, manifest))
    return sorted(found, key=lambda item: item[1].save_number)


def _numbered_entries(root: Path) -> list[tuple[Path, int]]:
    """The ``checkpoint_<N>`` entries of ``root`` (of any kind) with their N, in name order; none when
    ``root`` cannot be listed."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    return [(entry, int(match.group(1))) for entry in entries if (match := _NAME.fullmatch(entry.name))]


def next_save_number(root: Path) -> int:
    """One more than any ``checkpoint_<N>`` name already taken, complete or not (so numbering continues
    across resumes and never lands on an existing folder). A complete checkpoint's manifest records
    the N of its name, so reading manifests could add no larger number."""
    return max((number for _, number in _numbered_entries(root)), default=-1) + 1


def temporary_folder(root: Path, save_number: int | str) -> Path:
    """``.tmp-checkpoint_<N or name>-<pid>@<host>-<random>`` in ``root`` (created)."""
    root.mkdir(parents=True, exist_ok=True)
    # The writer's pid and host in the name: clean_temporaries leaves a live writer's folder alone.
    path = root / f"{_TEMP_PREFIX}{save_number}-{os.getpid()}@{_host()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def commit(temporary: Path, final: Path, manifest: Manifest, label: int | str | None = None) -> Path:
    """Write the manifest (last; the files it lists must already be fsynced), make it durable, and
    rename the folder into place. ``label``: the fault points' name of this save (default: its number).

    An existing ``final`` (an explicit ``save_state(dir)`` called twice, a best evaluation's weights
    written again) is replaced: moved aside first, deleted only after the new folder is in place.
    """
    label = manifest.save_number if label is None else label
    manifest.created = manifest.created or time.strftime("%Y-%m-%dT%H:%M:%S%z")
    fault_point("before-manifest", label)
    write_bytes(temporary / MANIFEST_FILE, manifest.to_json().encode())
    fsync_path(temporary / MANIFEST_FILE)
    fault_point("before-rename", label)
    publish(temporary, final)
    return final


def _host() -> str:
    return re.sub(r"[^\w.-]", "_", socket.gethostname())


_OWNER = re.compile(r"-(\d+)@([\w.-]+)-[0-9a-f]+(-old)?$")


def _owned_by_another_live_process(path: Path) -> bool:
    """Whether a temporary folder's name says a process other than this one, still running on this
    host, writes it. (A run folder is locked by its run, so this matters only for several scripts
    sharing a project_dir; a writer on another host is not waited for.)"""
    match = _OWNER.search(path.name)
    if match is None or match.group(2) != _host() or int(match.group(1)) == os.getpid():
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_temporaries(root: Path) -> None:
    """Remove ``.tmp-checkpoint_*`` folders left by a crash: only our own names, never one a live
    process (on this host) is still writing, and in this process only between its saves (saves are
    sequential, on the main process)."""
    try:
        leftovers = [e for e in root.iterdir() if e.name.startswith(_TEMP_PREFIX) and e.is_dir()]
    except OSError:
        return
    for path in leftovers:
        if _owned_by_another_live_process(path):
            continue
        log.info("removing %s, left by an interrupted save", path)
        shutil.rmtree(path, ignore_errors=True)


def best_checkpoint(checkpoints: list[tuple[Path, Manifest]]) -> Path | None:
    """The checkpoint with the best recorded metric: the oldest among equals (the best is the first
    evaluation that reached it, as the engine's early stopping counts)."""
    best: tuple[Path, float] | None = None
    for path, manifest in checkpoints:
        value = manifest.metric_value()
        if value is None:
            continue
        sign = -1.0 if (manifest.metric or {}).get("mode") == "min" else 1.0
        if best is None or sign * value > sign * best[1]:
            best = (path, value)
    return best[0] if best else None


def rotate(root: Path, total_limit: int | None, keep_best: bool, newest: Path,
           keep_steps: Collection[int] = (), keep_weights: Callable[[Path, Manifest], object] | None = None
           ) -> list[Path]:
    """Delete complete checkpoints beyond the ``total_limit`` newest, never ``newest`` (the one just
    written), nor, with ``keep_best``, the best one. One of a step in ``keep_steps`` (the engine's: those
    holding the weights of a best evaluation still in use) is handed to ``keep_weights`` first, which
    keeps its weights apart, then deleted; without ``keep_weights`` it is kept whole. Returns what was
    deleted."""
    if total_limit is None:
        return []
    checkpoints = complete_checkpoints(root)
    keep = {path for path, _ in checkpoints[-total_limit:]} | {newest}
    if keep_weights is None:
        keep |= {path for path, manifest in checkpoints if manifest.step in keep_steps}
    if keep_best and (best := best_checkpoint(checkpoints)) is not None:
        keep.add(best)
    removed = []
    for path, manifest in checkpoints:
        if path in keep:
            continue
        if keep_weights is not None and manifest.step in keep_steps:
            keep_weights(path, manifest)
        remove(root, path)
        removed.append(path)
    return removed


def remove(root: Path, path: Path) -> None:
    """Delete a committed folder of ``root``: renamed first, so a crash mid-delete leaves a ``.tmp-*``
    folder (cleaned up later), never half a checkpoint."""
    doomed = root / f"{_TEMP_PREFIX}rotated-{path.name}-{secrets.token_hex(4)}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# -- reading a committed folder's states -------------------------------------------------------------


def state_file(folder: Path, name: str) -> Path | None:
    """The file holding state ``name`` in a checkpoint: whichever of ``<name>.safetensors`` and
    ``<name>.json`` its manifest lists (the manifest is the only truth: a file it does not list is
    never read). In a folder without a manifest (not committed: a test, a save in progress),
    whichever exists."""
    listed = listed_files(folder)
    for suffix in (".safetensors", ".json"):
        file = f"{name}{suffix}"
        if file in listed if listed is not None else (folder / file).is_file():
            return folder / file
    return None


def read_state(folder: Path, name: str) -> Any:
    """The state ``format.write_state`` wrote; FileNotFoundError when there is none, CheckpointError
    (naming the file) when it is not well-formed."""
    path = state_file(folder, name)
    if path is None:
        raise FileNotFoundError(f"{folder / name}.(json|safetensors)")
    return read_state_file(path)


def load_into(obj: Any, folder: Path, name: str, convert: Callable[[Any], Any] | None = None) -> None:
    """``obj.load_state_dict`` of state ``name`` (through ``convert``), or one sentence saying why not."""
    try:
        state = read_state(folder, name)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {name} state, so it was saved with different objects "
                              f"(another script or config?).") from None
    try:
        obj.load_state_dict(convert(state) if convert is not None else state)
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"the {name} state in {folder} does not fit this run ({first_line(err)}).") from None


# -- choosing what to resume from --------------------------------------------------------------------


def checkpoints_root(path: Path) -> Path | None:
    """The ``checkpoints/`` folder meant by a run folder or a checkpoints folder, else None."""
    if (path / CHECKPOINTS_DIR).is_dir():
        return path / CHECKPOINTS_DIR
    if path.is_dir() and (path.name == CHECKPOINTS_DIR or any(_NAME.fullmatch(e.name) for e in path.iterdir())):
        return path
    return None


def is_checkpoint_folder(path: Path) -> bool:
    return (path / MANIFEST_FILE).exists() or bool(_NAME.fullmatch(path.name))


def _unusable_names(root: Path, newer_than: int) -> list[tuple[Path, str]]:
    """``checkpoint_<N>`` entries newer than ``newer_than`` that are not checkpoints at all (a
    symlink, no or a broken manifest), with the reason: a resume that passes over them says so."""
    found = []
    for entry, number in sorted(_numbered_entries(root), key=lambda item: item[1]):
        if number <= newer_than:
            continue
        if entry.is_symlink():
            found.append((entry, "it is a symlink (symlinks inside checkpoints are refused)"))
        elif entry.is_dir():
            manifest = read_manifest(entry)
            if manifest is None:
                found.append((entry, "its manifest.json is missing, truncated or unreadable"))
            elif manifest.save_number != number:
                found.append((entry, f"its manifest records save {manifest.save_number}, not {entry.name.removeprefix(CHECKPOINT_PREFIX)}"))
    return found


def find_checkpoint(path: Path, deep: bool = True, warn: bool = True) -> Path:
    """The checkpoint to resume from for ``resume=<path>`` (a run folder, its ``checkpoints/``, or one
    checkpoint). In a folder of checkpoints it is the newest that verifies; a newer one that does not
    (or a newer ``checkpoint_<N>`` that is no checkpoint at all) is skipped with a warning naming it
    and why. Raises CheckpointError (one sentence) when there is none.

    ``deep=False`` checks names and sizes only (no hashing), for a quick look before the run starts;
    ``warn=False`` leaves the warnings to the deep check.
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
    if root is not None and root.is_symlink():
        raise CheckpointError(f"{root} is a symlink; symlinks inside run folders are refused (resume from the "
                              "folder it points to instead).")
    candidates = complete_checkpoints(root) if root is not None else []
    rejected = []
    for folder, problem in _unusable_names(root, -1) if root is not None else []:
        if warn and (not candidates or int(folder.name.rsplit("_", 1)[1]) > candidates[-1][1].save_number):
            log.warning("skipping checkpoint %s: %s", folder, problem)
        rejected.append(f"{folder.name} ({problem})")
    if not candidates:
        raise CheckpointError(f"resume={path} contains no checkpoint (expected checkpoints/checkpoint_<N>/manifest.json)"
                              + (f"; not usable: {'; '.join(rejected)}." if rejected else "."))
    rejected = []
    for folder, _ in reversed(candidates):
        problem = check(folder)
        if problem is None:
            return folder
        if warn:
            log.warning("skipping checkpoint %s: %s", folder, problem)
        rejected.append(f"{folder.name} ({problem})")
    raise CheckpointError(f"no checkpoint in {root} verifies: {'; '.join(rejected)}.")


def run_folder_of(checkpoint: Path) -> Path:
    """The run folder a checkpoint belongs to (``<run>/checkpoints/checkpoint_<N>``)."""
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS_DIR else checkpoint.parent


# -- fault injection (tests only) --------------------------------------------------------------------

FAULT_ENV = "APP_CHECKPOINT_FAULT"
"""Fault-injection point for the crash tests: ``APP_CHECKPOINT_FAULT=<point>:<save number>`` makes the
process SIGKILL itself at ``<point>`` of that save, where point is ``files`` (half the files
written), ``before-manifest``, ``before-rename`` or ``before-rotate``; ``disk-full`` makes the
write after half the files fail with ENOSPC instead (for machines where a test cannot mount a small
tmpfs); ``hold`` makes that save wait for ever after half the files, in Python, so signal handlers run
(a test's second Ctrl-C always lands inside a checkpoint write), saying so on stderr with
:data:`HOLD_MESSAGE`, the save's number and, where its metadata gives it, its training step
(``checkpoint write held halfway (save 4, step 28, <folder>)``). Unset in normal use."""
HOLD_MESSAGE = "checkpoint write held halfway"


def fault_point(point: str, save_number: int | str, path: Path | None = None, step: int | None = None) -> None:
    """``save_number``: the N of ``checkpoint_<N>``, or the name of another folder the store writes
    (``best_<step>``, the kept weights of a best evaluation: ``files:best_15``)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    wanted, _, number = spec.partition(":")
    if number and str(save_number) != number:
        return
    if wanted == point:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if wanted == "disk-full" and point == "files":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    if wanted == "hold" and point == "files":
        import time

        at_step = f", step {step}" if step is not None else ""
        os.write(2, f"{HOLD_MESSAGE} (save {save_number}{at_step}, {path})\n".encode())
        while True:
            time.sleep(0.05)

