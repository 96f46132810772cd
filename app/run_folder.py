"""A run folder belongs to one run.

- **Lock.** A run holds an exclusive ``fcntl.flock`` on ``<run folder>/.lock`` for its whole life
  (taken by the process that ran Hydra: the launcher of a multi-process run, rank 0 under torchrun;
  every rank's writes happen while it holds it). The file records the holder's pid and host. A second
  run on the folder is refused ("in use by process N on host H"). The kernel drops the lock when
  its holder dies, even by SIGKILL, so a stale ``.lock`` file is simply taken over. A run that ends
  deletes the file while still holding the lock; a process that locked a file deleted meanwhile
  retries on the new one, so two runs never both hold the folder.
- **One run per folder.** A new run (no ``resume=``) pointed at a folder that already holds a run's
  results (``checkpoints/checkpoint_<N>``, ``model/`` or ``metrics.jsonl``) is refused, unless
  ``overwrite=true``, which moves the old folder aside to ``<folder>.replaced-<time>`` (nothing is
  deleted).
- **A refused resume changes nothing.** When resuming into an existing run folder, Hydra is told not
  to write ``.hydra/`` (``hydra.output_subdir=null``); the run writes those files itself, atomically,
  once the checkpoint is accepted (:func:`write_hydra_record`).

Checked on the raw command line before Hydra starts (``claim_from_argv``) where the folder is
named explicitly; the lock is (re)taken in ``app.__main__.main`` for every job, including the
timestamped folders Hydra picks and the jobs of a sweep.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.config import ConfigError
from app.launching.overrides import override_key
from app.run_layout import HYDRA_DIR, LOCK_FILE, checkpoints_dir, metrics_file, model_dir

HYDRA_SUBDIR = HYDRA_DIR


class RunFolderError(ConfigError):
    """The run folder cannot be used by this run; the message is one sentence."""


@dataclass
class RunFolderLock:
    folder: Path
    fd: int

    @classmethod
    def acquire(cls, folder: Path) -> RunFolderLock:
        """Lock ``folder`` (created if needed) or raise RunFolderError naming the holder."""
        path = folder / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = os.pread(fd, 200, 0).decode(errors="replace").split()
                os.close(fd)
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise RunFolderError(f"cannot lock the run folder {folder} ({err.strerror}).") from None
                who = (f"process {holder[0]} on host {holder[1]}" if len(holder) >= 2
                       else "another process")
                raise RunFolderError(f"the run folder {folder} is in use by {who}; wait for that run to end "
                                     "or choose another hydra.run.dir.") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its holder deleted the file as we locked it: lock the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        return cls(folder, fd)

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.unlink(self.folder / LOCK_FILE)  # while still locked: see the module docstring
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


@dataclass
class Claims:
    """The run folders this process holds, and whether Hydra's record was deferred (resume)."""

    locks: dict[Path, RunFolderLock] = field(default_factory=dict)
    deferred_record: bool = False

    def hold(self, folder: Path) -> RunFolderLock:
        key = folder.resolve()
        if key not in self.locks:
            self.locks[key] = RunFolderLock.acquire(folder)
        return self.locks[key]

    def release(self, folder: Path) -> None:
        lock = self.locks.pop(folder.resolve(), None)
        if lock is not None:
            lock.release()

    def release_all(self) -> None:
        for folder in list(self.locks):
            self.release(folder)


CLAIMS = Claims()
"""This process's claims: ``claim_from_argv`` (before Hydra) and ``main`` (after) share them."""


def holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` has results of an earlier run that a new run would mix with or destroy."""
    checkpoints = checkpoints_dir(folder)
    try:
        has_checkpoint = checkpoints.is_dir() and any(e.name.startswith("checkpoint_") for e in checkpoints.iterdir())
    except OSError:
        has_checkpoint = False
    return has_checkpoint or model_dir(folder).exists() or metrics_file(folder).exists()


def make_writable(folder: Path) -> None:
    """Create ``folder`` or raise RunFolderError saying why it cannot be a run folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise RunFolderError(f"hydra.run.dir={folder} cannot be used as a run folder ({err.strerror}); "
                             "choose a writable folder.") from None


def move_aside(folder: Path) -> Path:
    """Rename ``folder`` to a free ``<folder>.replaced-<time>[-k]`` sibling (nothing is deleted)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder.with_name(f"{folder.name}.replaced-{stamp}")
    k = 1
    while target.exists():
        k += 1
        target = folder.with_name(f"{folder.name}.replaced-{stamp}-{k}")
    os.rename(folder, target)
    return target


def claim_new_run(folder: Path, resume: str | None, overwrite: bool) -> Path | None:
    """Checks for an explicitly named run folder, then lock it. Returns where an overwritten
    earlier run was moved, if one was."""
    make_writable(folder)
    if overwrite and resume is not None:
        raise RunFolderError("overwrite=true starts a new run in the folder; it cannot be combined with "
                             f"resume={resume}.")
    moved = None
    if resume is None and holds_a_run(folder):
        if not overwrite:
            raise RunFolderError(
                f"hydra.run.dir={folder} already holds a run (checkpoints, model/ or metrics.jsonl); continue it "
                f"with resume={folder}, choose a new folder, or pass overwrite=true to move it aside.")
        RunFolderLock.acquire(folder).release()  # refused if a live run holds it
        moved = move_aside(folder)
        make_writable(folder)
    CLAIMS.hold(folder)
    return moved


# -- the raw command line ----------------------------------------------------------------------------


def _value(argv: list[str], key: str) -> str | None:
    values = [arg.split("=", 1)[1] for arg in argv if override_key(arg) == key and "=" in arg]
    if not values:
        return None
    value = values[-1].strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return value


def claim_from_argv(argv: list[str]) -> list[str]:
    """Before Hydra: when the command line names the run folder (``hydra.run.dir=...``, as a resume
    and torchrun do), check it, lock it, and, when resuming into an existing folder, defer Hydra's
    ``.hydra/`` record until the resume is accepted. Returns the arguments to give Hydra."""
    if any(arg in ("-m", "--multirun") for arg in argv) or int(os.environ.get("RANK", "0")) != 0:
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
    if resume is not None and (folder / HYDRA_SUBDIR).is_dir() and _value(argv, "hydra.output_subdir") is None:
        CLAIMS.deferred_record = True
        return [*argv, "hydra.output_subdir=null"]
    return argv


def write_hydra_record(run_dir: Path, record: dict[str, str]) -> None:
    """Write the deferred ``.hydra/`` files (name -> YAML text), each atomically."""
    folder = run_dir / HYDRA_SUBDIR
    folder.mkdir(exist_ok=True)
    for name, text in record.items():
        temporary = folder / f".{name}.tmp-{os.getpid()}"
        temporary.write_text(text)
        os.replace(temporary, folder / name)
