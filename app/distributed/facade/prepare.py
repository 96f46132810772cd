"""The Accelerator's ``prepare`` verbs: models placed and wrapped for the backend (and unwrapped),
optimizers and schedulers wrapped to step with gradient accumulation, data loaders sharded over the
processes (``app/distributed/data/``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from app.distributed.data.expanded import ExpandedLoader, MakeBatches
from app.distributed.data.map_style import DataLoaderShard, draw_generator_seed, shard_dataloader
from app.distributed.data.map_style import skip_first_batches as _skip_first_batches
from app.distributed.data.stream import ShardedStream, StreamLoaderShard
from app.distributed.facade.fields import AcceleratorFields
from app.distributed.placeholders import refuse_placeholder
from app.distributed.wrappers import AcceleratedOptimizer, AcceleratedScheduler


class Preparing(AcceleratorFields):
    """``Accelerator``'s ``prepare`` verbs (a mixin; the fields are ``AcceleratorFields``')."""

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Wrap models, optimizers, dataloaders and schedulers for this runtime; returns them in the
        order given (a single object is returned as itself).

        Models are prepared first, so an optimizer created on the original parameters is re-pointed at
        the parameters the backend produced (FSDP2 replaces them with sharded ones).

        ``device_placement``: one bool per object (None: the Accelerator's ``device_placement``).
        """
        if device_placement is None:
            device_placement = [self.device_placement] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for the {len(args)} objects "
                             "passed; give one per object.")
        for obj in args:
            refuse_placeholder(obj)
        replaced: dict[int, nn.Parameter] = {}
        result: list[Any] = list(args)
        for i, obj in enumerate(args):
            if isinstance(obj, nn.Module):
                old = list(obj.parameters())
                result[i] = self.prepare_model(obj, device_placement=device_placement[i])
                new = list(self.backend.unwrap_model(result[i]).parameters())
                replaced.update({id(o): n for o, n in zip(old, new) if o is not n})
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.Optimizer):
                if replaced:
                    for group in obj.param_groups:
                        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
                result[i] = self.prepare_optimizer(obj, device_placement=device_placement[i])
            elif isinstance(obj, DataLoader):
                result[i] = self.prepare_data_loader(obj, device_placement=device_placement[i])
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                result[i] = self.prepare_scheduler(obj)
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> nn.Module:
        """Place the model on the device, wrap it for the backend (DDP, FSDP2...) and run its forward
        under the precision's autocast. ``device_placement=False`` leaves a model where it is only
        when that is the device already: the backend's wrapper needs it there.

        ``evaluation_mode=True``: a frozen model that only runs forward beside the trained one (a DPO
        reference, a teacher). Placed and sharded as the trained model is (FSDP2: the same
        ``fully_shard`` units, each process holds its share, so its forward is a collective every
        process must run), its forward under the same autocast; never wrapped for DDP, and not saved
        with checkpoints (it does not change). Accelerate leaves such a model unsharded."""
        if evaluation_mode:
            return self._prepare_frozen(model)
        place = device_placement if device_placement is not None else self.device_placement
        if not place and any(p.device != self.device for p in model.parameters()):
            raise ValueError(f"device_placement=False: the backend places and wraps the model on {self.device} "
                             "(its data-parallel wrappers need it there); move it there first, or leave device_placement on.")
        if any(model is m or model is self.backend.unwrap_model(m) for m in self._models):
            raise ValueError("this model was already prepared; prepare each model once.")
        if self.num_processes > 1 and self.verify_device_map(model):
            raise ValueError("this model was loaded with a device_map over several devices; it cannot be trained "
                             "on several processes (load it without device_map).")
        wrapped = self._in_autocast(self.backend.wrap_model(model))
        self._models.append(wrapped)
        return wrapped

    def _prepare_frozen(self, model: nn.Module) -> nn.Module:
        if any(p.requires_grad for p in model.parameters()):
            raise ValueError("prepare_model(evaluation_mode=True) takes a frozen model (it is never trained or "
                             "synchronised): call model.requires_grad_(False) first.")
        return self._in_autocast(self.backend.wrap_model(model.eval()))

    def _in_autocast(self, wrapped: nn.Module) -> nn.Module:
        inner = self.backend.unwrap_model(wrapped)
        # The autocast decision is taken once here, not at every step.
        wrapped_forward = self.precision.wrap_forward(inner.forward, self.autocast_handler)
        if wrapped_forward is not inner.forward:
            inner.forward = wrapped_forward  # type: ignore[method-assign]
        return wrapped

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> AcceleratedOptimizer:
        """Wrap the optimizer so it steps only on synchronising micro-steps. With device placement
        (the default), a state it already holds (loaded before ``prepare``) moves to its parameters'
        devices; without, it stays where it is."""
        place = device_placement if device_placement is not None else self.device_placement
        if place and optimizer.state:
            optimizer.load_state_dict(optimizer.state_dict())  # torch casts the state to each parameter's device
        wrapped = AcceleratedOptimizer(optimizer, self.gradient_state, self.precision,
                                       step_end=self.backend.step_end_hook())
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> AcceleratedScheduler:
        optimizers = [o for o in self._optimizers if o.optimizer is scheduler.optimizer or o is scheduler.optimizer]
        # Accelerate steps the scheduler once per process per optimizer step (unless split_batches),
        # so a schedule sized for one process's batches ends when the data does.
        per_step = 1 if self.split_batches or not self.scale_scheduler_by_processes else self.num_processes
        wrapped = AcceleratedScheduler(scheduler, optimizers or self._optimizers, self.gradient_state,
                                       self.step_scheduler_with_optimizer, steps_per_optimizer_step=per_step)
        self._schedulers.append(wrapped)
        return wrapped

    def _generator_seed(self) -> int:
        """The seed of the generator a shuffling sampler gets on several processes when it has none:
        one int64 drawn from the global torch RNG, as Accelerate draws it (so the same ``set_seed``
        gives the same batches per rank), rank 0's value on every rank. Drawn again for each loader."""
        return int(self.backend.broadcast_object(draw_generator_seed(), src=0))

    def _order_seed(self) -> int | None:
        """The seed the prepared loaders shuffle from, or None to follow the user's sampler."""
        if self._seed is not None:
            return self._seed
        config = self.dataloader_config
        if config.data_seed is not None:
            return config.data_seed
        if config.use_seedable_sampler:
            return int(self.backend.broadcast_object(torch.initial_seed(), src=0))
        return None

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> Any:
        config = self.dataloader_config
        placed = device_placement if device_placement is not None else self.device_placement
        device = self.device if placed else torch.device("cpu")
        iterable = isinstance(data_loader.dataset, IterableDataset)
        place = (functools.partial(self.backend.place_batch, non_blocking=config.non_blocking)
                 if device.type != "cpu" else None)
        if iterable and isinstance(data_loader.dataset, ShardedStream):
            # Each process reads its own part and checkpoints its own position (app/distributed/data/stream.py).
            shard: Any = StreamLoaderShard(data_loader, backend=self.backend, device=device,
                                           state=self.gradient_state, place=place)
        elif iterable or config.dispatch_batches:
            from app.distributed.data.iterable import IterableDataLoaderShard

            dispatch = config.dispatch_batches if config.dispatch_batches is not None else True
            shard = IterableDataLoaderShard(data_loader, backend=self.backend, device=device,
                                            state=self.gradient_state, split_batches=config.split_batches,
                                            even_batches=config.even_batches, dispatch=dispatch)
        else:
            shard = shard_dataloader(
                data_loader,
                device=device,
                state=self.gradient_state,
                num_processes=self.num_processes,
                process_index=self.process_index,
                seed=self._order_seed(),
                even_batches=config.even_batches,
                split_batches=config.split_batches,
                agreed_seed=self._generator_seed,
                synchronize=self._synchronize_generator if "generator" in self.rng_types else None,
                own_rng=self._seed is not None,
                fixed_shapes=self.static_shapes,
                place=place,
                prefetch=self.backend.prefetch_depth,
            )
        self._dataloaders.append(shard)
        return shard

    def _synchronize_generator(self, generator: torch.Generator) -> None:
        generator.set_state(self.backend.broadcast(generator.get_state(), 0))

    def skip_first_batches(self, dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard:
        """Resume inside an epoch: the next iteration starts ``num_batches`` batches in, without
        loading the skipped samples (a stream continues from the position its checkpoint restored)."""
        if isinstance(dataloader, (StreamLoaderShard, ExpandedLoader)):
            return dataloader.skip_first_batches(num_batches)  # type: ignore[return-value]
        return _skip_first_batches(dataloader, num_batches)

    def expand_batches(self, dataloader: DataLoaderShard, make: MakeBatches, per_batch: int,
                       pending: Any, batch_size: int | None = None) -> ExpandedLoader:
        """A prepared (map-style) training loader whose every batch becomes ``per_batch`` micro-batches, placed
        on the device as they are handed out: ``make(batch, step)`` makes them (``step``: the optimizer step
        their first one trains in), ``pending()`` gives again those of the batch partly trained before a
        checkpoint (the caller checkpoints what it needs for that). Lengths, positions and resumption count
        micro-batches, and gradient accumulation closes the epoch's last optimizer step at its last micro-batch
        (``app/distributed/data/expanded.py``); the loader's position within a batch is checkpointed.
        ``batch_size``: the samples a micro-batch holds (None: the loader's batch size).

        >>> loader = accelerator.expand_batches(loader, lambda batch, step: split(batch, 4), 4, lambda: kept)
        """
        if not isinstance(dataloader, DataLoaderShard):
            raise TypeError("expand_batches() takes a prepared map-style training loader")
        expanded = ExpandedLoader(dataloader, make, per_batch, pending, self.gradient_state,
                                  self.gradient_accumulation_steps, dataloader.device,
                                  batch_size if batch_size is not None else dataloader.batch_size)
        self._custom_objects.append(expanded)  # its place in a batch (register_for_checkpointing's list)
        return expanded

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        """The user's model inside the backend's wrapper. ``keep_fp32_wrapper=False``: its forward
        without the precision's autocast; ``keep_torch_compile=False``: the module a
        ``torch.compile(model)`` wrapper compiles (a model compiled in place is itself)."""
        inner = self.backend.unwrap_model(model)
        if not keep_torch_compile:
            inner = getattr(inner, "_orig_mod", inner)  # torch.compile's OptimizedModule holds the original there
        if not keep_fp32_wrapper:
            forward = inner.forward
            original = getattr(forward, "__wrapped__", None)
            if original is not None:
                inner.forward = original  # type: ignore[method-assign]
        return inner


    def verify_device_map(self, model: nn.Module) -> bool:
        """True when the model was loaded with a ``device_map`` spreading it over several devices."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

