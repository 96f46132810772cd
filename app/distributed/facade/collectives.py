"""The Accelerator's collectives: gathering (``gather_for_metrics`` drops the duplicates that even out
a last batch, and never returns un-deduplicated data), reducing, padding, broadcasting; the per-step
flag every process reads at the same step; device scalars read on the host without a stall."""

from __future__ import annotations

from typing import Any

import torch

from app.distributed.facade.fields import AcceleratorFields
from app.distributed.functional import pad_with, reduce_with
from app.distributed.host_reads import HostRead
from app.distributed.operations import recursively_apply
from app.distributed.step_flags import StepFlag


class Collectives(AcceleratorFields):
    """``Accelerator``'s collectives (a mixin): each runs on the Accelerator's own backend."""

    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors (or nested structures of them) from all processes along dim 0."""
        return recursively_apply(self.backend.all_gather, tensor)

    def gather_object(self, obj: Any) -> list[Any]:
        """Gather any picklable object; lists are concatenated, other objects collected one per rank."""
        gathered = self.backend.all_gather_object(obj)
        if isinstance(obj, list):
            return [item for part in gathered for item in part]
        return gathered

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather per-sample data for metrics, dropping the duplicates added to even out the last batch.

        The rule: at the last batch of a prepared dataloader, everything per-sample (tensors with a
        batch dimension, and lists when gathered as objects) is cut to the number of real samples in
        that global step. A 0-d tensor, or a non-list object, is a per-rank value, not per-sample
        data: every rank's value is kept. Nothing is caught and returned un-deduplicated: if the
        data cannot be gathered, the error is raised.
        """
        state = self.gradient_state
        at_end = state.end_of_dataloader and state.remainder > 0
        remainder = state.remainder
        if use_gather_object or not _all_tensors(input_data):
            data = self.gather_object(input_data)
            return data[:remainder] if at_end and isinstance(input_data, list) else data

        def gather_trimmed(t: torch.Tensor) -> torch.Tensor:
            gathered = self.backend.all_gather(t)
            return gathered[:remainder] if at_end and t.dim() > 0 else gathered

        return recursively_apply(gather_trimmed, input_data)

    def local_for_metrics(self, input_data: Any) -> Any:
        """This process's share of what :meth:`gather_for_metrics` returns: its per-sample rows without
        the duplicates that complete a prepared loader's last global batch, for metrics that each
        process sums and :meth:`reduce` then adds up (a language model's token losses: no per-sample
        gather). Outside a last batch, and for 0-d tensors, the data is returned as it is.

        >>> totals += accelerator.local_for_metrics(per_sample_losses).sum()
        >>> totals = accelerator.reduce(totals)
        """
        state = self.gradient_state
        if not (state.end_of_dataloader and state.remainder > 0):
            return input_data
        # Process r's rows are the global step's samples r*b to (r+1)*b - 1 (b: a process's batch size).
        first = self.process_index * state.active_dataloader.batch_size
        keep = max(0, state.remainder - first)

        def trim(t: torch.Tensor) -> torch.Tensor:
            return t[:keep] if t.dim() > 0 else t

        return recursively_apply(trim, input_data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce tensors across processes with ``sum``, ``mean``, ``max`` or ``min``."""
        return reduce_with(self.backend, tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size any process has, so they can be gathered."""
        return pad_with(self.backend, tensor, dim, pad_index, pad_first)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        return recursively_apply(lambda t: self.backend.broadcast(t, from_process), tensor)

    def broadcast_object(self, obj: Any, from_process: int = 0) -> Any:
        """Any picklable object from ``from_process`` to every process; returns that process's value.

        >>> found = accelerator.broadcast_object(path if accelerator.is_main_process else None)
        """
        return self.backend.broadcast_object(obj, src=from_process)

    def step_flag(self) -> StepFlag:
        """A per-step "did any process raise it?" whose answer every process reads at the same step
        (``app/distributed/step_flags.py``): one step late and without a wait on the
        ``torch.distributed`` backends, a blocking all-reduce on the others (the identity on one process).

        >>> flag = accelerator.step_flag()
        >>> for batch in loader:
        ...     train_step(batch)
        ...     if flag.post(stop_requested_here()):
        ...         break
        >>> flag.close()
        """
        return self.backend.step_flag()

    @property
    def reads_lag(self) -> bool:
        """Whether :meth:`read_async` returns before its values are in, because the device runs ahead of
        the host (CUDA, XLA): ask for its result a step later. False on the CPU (read at once)."""
        return self.backend.ops.reads_lag

    def read_async(self, *tensors: torch.Tensor) -> HostRead:
        """Start reading device scalars on the host without waiting for the device to catch up: on CUDA
        a copy into pinned memory and an event, on XLA the launched step's outputs themselves, on the
        CPU the values at once (``app/distributed/host_reads.py``). The tensors are the reader's from
        now on: do not change them in place (start a new running sum instead).

        >>> reading = accelerator.read_async(loss_sum)
        >>> loss_sum = torch.zeros((), device=accelerator.device)
        >>> ...                               # the next optimizer step
        >>> (total,) = reading.result()
        """
        return self.backend.ops.read_async(tensors)


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return all(_all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_all_tensors(v) for v in data)
    return False
