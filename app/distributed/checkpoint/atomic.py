"""The one way a checkpoint, an export or an exported file becomes visible: written completely under a
temporary name next to where it goes, made durable (fsync), then renamed into place, and the rename
made durable too (fsync of the parent folder). A crash at any point leaves what was there before or
the new thing complete, plus at most a temporary that the next writer removes; a reader never sees
half of it.

Whoever writes chooses the temporary's name (the store names checkpoint folders so that a crashed
writer's leftovers are recognised) and fsyncs what it wrote (``format.finish`` does it while hashing);
:func:`publish` is the rename.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path


def temporary_sibling(final: Path) -> Path:
    """``.<name>.tmp-<random>`` beside ``final``: hidden, and never the name of anything finished."""
    return final.with_name(f".{final.name}.tmp-{secrets.token_hex(4)}")


def publish(temporary: Path, final: Path) -> None:
    """Rename a fully written file or folder to ``final`` and make the rename durable. The files'
    bytes must already be fsynced; a folder's entries are fsynced here, before the rename.

    A file already at ``final`` is replaced by the rename itself. A folder already there is moved
    aside first (named after the temporary plus ``-old``, so a crash leaves it where temporaries are
    cleaned up) and deleted only once the new folder is in place."""
    old = None
    if temporary.is_dir():
        fsync_path(temporary)
    if temporary.is_dir() and final.exists():
        old = temporary.with_name(temporary.name + "-old")
        os.rename(final, old)
    os.replace(temporary, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a folder's entries (a rename, a new file), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_paths(paths: Iterable[Path]) -> None:
    for path in paths:
        fsync_path(path)
