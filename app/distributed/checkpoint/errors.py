"""What a checkpoint operation raises when it cannot go on: each carries one sentence for the user."""

from __future__ import annotations

import errno

from app.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, incomplete, tampered with, or for another model."""


class DiskFullError(RuntimeError):
    """A save ran out of space (ENOSPC or a quota); the message is one sentence. What was written
    of that save is removed; earlier checkpoints are untouched."""


class CheckpointWriteError(RuntimeError):
    """A save that failed for another reason than space (an I/O error, a process that could not write
    its part); the message is one sentence. Nothing of that save was committed; earlier checkpoints
    are untouched."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def first_line(err: BaseException) -> str:
    """An exception's first line, for the end of a one-sentence message."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
