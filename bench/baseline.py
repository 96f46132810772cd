"""What every benchmark's plain loop shares with ours, so that a ratio measures our overhead only.

A benchmark compares our runtime or engine against the best loop a user could write by hand doing
exactly the same work. The pieces here are that "same work":

- the data and its order: :class:`EpochOrder` draws each epoch's permutation from ``seed + epoch``
  with its own generator, which is what our sharded sampler does, and deals rank ``r`` batch ``r``
  of every global step, so a plain loop visits the samples our loader visits, in the same order;
- the optimizer: :func:`adamw` is torch's fused AdamW wherever the kernel exists (what the engine
  picks with ``optim.fused=null``), the default implementation elsewhere;
- the plain loop's own best settings: ``zero_grad(set_to_none=True)`` and no host sync per step
  (the loss is read once every ``LOG_EVERY`` steps, as the engine logs it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import Sampler, TensorDataset

LOG_EVERY = 10
"""Both loops read the loss on the host once every this many steps (the engine's default)."""


def digits_data() -> TensorDataset:
    """scikit-learn's 8x8 digits (1,797 samples) as float features in [0, 1] and integer labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return TensorDataset(torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target))


def fused_available(device: torch.device) -> bool:
    """Whether torch's fused AdamW kernel runs on this device (CPU and CUDA have it)."""
    return device.type in ("cpu", "cuda")


def adamw(params: Iterable[torch.nn.Parameter] | Iterable[dict], lr: float = 1e-3,
          device: torch.device | None = None, **kwargs: float) -> torch.optim.AdamW:
    """AdamW as the engine builds it: fused where the device (default: CPU) has the kernel."""
    fused = fused_available(device if device is not None else torch.device("cpu"))
    return torch.optim.AdamW(params, lr=lr, fused=fused or None, **kwargs)


class EpochOrder(Sampler[list[int]]):
    """Batches of indices in our sharded sampler's order: one permutation per epoch from
    ``seed + epoch``, cut into global steps of ``num_processes`` batches, rank ``r`` taking batch
    ``r`` of each (the last global step completed from the epoch's start, as ``even_batches`` does).
    Call :meth:`set_epoch` like a ``DistributedSampler``."""

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, num_processes: int = 1,
                 process_index: int = 0):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.num_processes, self.process_index = num_processes, process_index
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _steps(self) -> int:
        global_batch = self.batch_size * self.num_processes
        return -(-self.num_samples // global_batch)

    def __len__(self) -> int:
        return self._steps()

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_samples, generator=generator).tolist()
        global_batch = self.batch_size * self.num_processes
        pad = self._steps() * global_batch - len(order)
        if pad > 0 and self.num_processes > 1:
            order += [order[i % len(order)] for i in range(pad)]
        for step in range(self._steps()):
            start = step * global_batch + self.process_index * self.batch_size
            batch = order[start:start + self.batch_size]
            if batch:
                yield batch
