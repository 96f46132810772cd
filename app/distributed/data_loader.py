"""Accelerate's ``accelerate.data_loader``: ``prepare_data_loader`` (shard one DataLoader without an
``Accelerator``), ``skip_first_batches``, ``DataLoaderShard`` and ``SeedableRandomSampler``, on the live
process group (``state.py``). The loaders themselves live in ``app/distributed/data/``."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from app.distributed.data.map_style import (
    DataLoaderShard,
    SeedableRandomSampler,
    draw_generator_seed,
    shard_dataloader,
)
from app.distributed.data.map_style import skip_first_batches as _skip
from app.distributed.operations import send_to_device
from app.distributed.state import GradientState, live_accelerator, live_backend


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: list[str] | None = None, dispatch_batches: bool | None = None,
                        even_batches: bool = True, slice_fn_for_dispatch: Any = None,
                        use_seedable_sampler: bool = False, data_seed: int | None = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: Any = None) -> Any:
    """Shard ``dataloader`` for process ``process_index`` of ``num_processes`` (default: the live
    ones), as ``Accelerator.prepare`` does. ``dispatch_batches`` (default: for iterable datasets when
    ``put_on_device``) makes the main process read and send every batch."""
    if slice_fn_for_dispatch is not None or torch_device_mesh is not None:
        raise ValueError("prepare_data_loader: slice_fn_for_dispatch and torch_device_mesh are not supported.")
    backend = live_backend()
    accelerator = live_accelerator()
    state = accelerator.gradient_state if accelerator is not None else GradientState()
    target = (device or backend.device) if put_on_device else torch.device("cpu")
    iterable = isinstance(dataloader.dataset, IterableDataset)
    dispatch = dispatch_batches if dispatch_batches is not None else (put_on_device and iterable)
    if iterable or dispatch:
        from app.distributed.data.iterable import IterableDataLoaderShard

        return IterableDataLoaderShard(dataloader, backend=backend, device=target, state=state,
                                       split_batches=split_batches, even_batches=even_batches, dispatch=dispatch)
    seed = data_seed if data_seed is not None else (
        int(backend.broadcast_object(torch.initial_seed(), src=0)) if use_seedable_sampler else None)

    def agreed_seed() -> int:
        return int(backend.broadcast_object(draw_generator_seed(), src=0))

    def synchronize(generator: torch.Generator) -> None:
        generator.set_state(backend.broadcast(generator.get_state(), 0))

    return shard_dataloader(dataloader, device=target, state=state,
                            num_processes=num_processes if num_processes is not None else backend.num_processes,
                            process_index=process_index if process_index is not None else backend.process_index,
                            seed=seed, even_batches=even_batches, split_batches=split_batches,
                            agreed_seed=agreed_seed, synchronize=synchronize,
                            place=(lambda batch: send_to_device(batch, target, non_blocking=non_blocking))
                            if target.type != "cpu" else None)


def skip_first_batches(dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard:
    return _skip(dataloader, num_batches)


__all__ = ["DataLoaderShard", "SeedableRandomSampler", "prepare_data_loader", "skip_first_batches"]
