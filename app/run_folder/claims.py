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
  once the checkpoint is accepted (``app.run_folder.record.write_hydra_record``).

Claimed before Hydra starts where the command line names the folder (``app.cli.argv``'s step
``claim_named_run_folder``: :func:`claim_new_run`); the lock is (re)taken in ``app.cli.job`` for every
job, including the timestamped folders Hydra picks and the jobs of a sweep.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.config import ConfigError
from app.run_folder.layout import CHECKPOINT_PREFIX, LOCK_FILE, checkpoints_dir, metrics_file, model_dir


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
    """The run folders this process holds, whether Hydra's record was deferred (resume), and the folders
    a claim created (taken back if Hydra then refuses the command line: :meth:`abandon`)."""

    locks: dict[Path, RunFolderLock] = field(default_factory=dict)
    deferred_record: bool = False
    created: list[Path] = field(default_factory=list)

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

    def abandon(self) -> None:
        """Hydra refused the command line: let go of every folder, and remove those the claims created
        (still empty: nothing was written)."""
        self.release_all()
        for folder in self.created:
            with contextlib.suppress(OSError):
                folder.rmdir()


CLAIMS = Claims()
"""This process's claims: the command line's (before Hydra) and the job's (after) share them."""


def holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` has results of an earlier run that a new run would mix with or destroy."""
    return has_checkpoints(folder) or model_dir(folder).exists() or metrics_file(folder).exists()


def has_checkpoints(folder: Path) -> bool:
    """Whether ``folder`` has a checkpoint (that ``resume=`` could continue)."""
    checkpoints = checkpoints_dir(folder)
    try:
        return checkpoints.is_dir() and any(e.name.startswith(CHECKPOINT_PREFIX) for e in checkpoints.iterdir())
    except OSError:
        return False


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
    existed = folder.exists()
    make_writable(folder)
    if overwrite and resume is not None:
        raise RunFolderError("overwrite=true starts a new run in the folder; it cannot be combined with "
                             f"resume={resume}.")
    moved = None
    if resume is None and holds_a_run(folder):
        if not overwrite:
            # resume= is offered only where it can work: a run that ended before its first checkpoint has none.
            go_on = f"continue it with resume={folder}, " if has_checkpoints(folder) else "it has no checkpoint to resume; "
            raise RunFolderError(
                f"hydra.run.dir={folder} already holds a run (checkpoints, model/ or metrics.jsonl); {go_on}choose a "
                "new folder, or pass overwrite=true to move it aside.")
        RunFolderLock.acquire(folder).release()  # refused if a live run holds it
        moved = move_aside(folder)
        make_writable(folder)
    CLAIMS.hold(folder)
    if not existed:
        CLAIMS.created.append(folder)
    return moved
