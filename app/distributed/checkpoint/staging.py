"""How a save takes the state out of the training objects: :class:`Staging`.

A synchronous save writes every file before training goes on, so it writes straight from the
tensors' own memory (no copy). An asynchronous save (``save_state(async_save=True)``) lets training
go on while a writer thread writes the files, so every tensor is first copied off the device into
host memory the save owns: after that, an optimizer step may change the originals. The host buffers
are kept from one save to the next (the previous write has finished before the next save copies),
pinned where the device has pinned memory (CUDA: the copy runs at full bus speed): an asynchronous
save holds one extra copy of the training state in host memory for the run. Copying into buffers
already touched also spares the page faults fresh memory costs, a good part of the copy's time.

A staged file is a :class:`Pending`: something whose ``write()`` puts it on disk (our own files,
from bytes in memory: ``format.PendingFile``; the FSDP2 weight shards that
torch.distributed.checkpoint writes: ``sharded_io.PendingShards``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from app.distributed.checkpoint.format import WrittenFile


class Pending(Protocol):
    """A checkpoint file (or a library's files) staged, not yet on disk."""

    def write(self) -> dict[str, WrittenFile | Path]:
        """Put it on disk; the files written, by name inside the checkpoint folder (a ``WrittenFile``
        still holds its bytes for hashing, a Path is hashed by reading it)."""
        ...


@dataclass
class Staging:
    """One save's way of taking tensors: by reference (``copy=False``, a synchronous save) or copied
    into host buffers (an asynchronous save)."""

    copy: bool = False
    pin_memory: bool = False
    """Host buffers in pinned memory (the device has it: CUDA)."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """The previous save's host buffers by key, reused when shape and dtype match."""
    used: dict[str, torch.Tensor] = field(default_factory=dict)
    """The buffers this save copied into: the next save's ``buffers``."""
    process_group: Any = None
    """The process group the ranks' writers synchronise on (torch.distributed.checkpoint's, in the
    writer thread); None: the default group."""
    now: bool = False
    """A library that writes its own files (FSDP2's shards) writes them while staging, even in an
    asynchronous save: for a second model of the checkpoint, whose library-threaded write would run
    its collectives beside the first one's on the same process group."""

    def host(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the host: itself when it is there and no copy is needed, else a copy (into
        this save's buffer ``key`` when copying)."""
        t = tensor.detach()
        if not self.copy:
            return t if t.device.type == "cpu" else t.cpu()
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
        buffer.copy_(t)
        self.used[key] = buffer
        return buffer

    def nbytes(self) -> int:
        """Host memory this save's copies take."""
        return sum(b.numel() * b.element_size() for b in self.used.values())
