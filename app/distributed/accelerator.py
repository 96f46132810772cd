"""``Accelerator``: the public runtime API, with the names and semantics documented by Hugging Face
Accelerate, built on our own backends (``backend.py``, ``torch_distributed.py``) and precision
objects (``precision.py``). It does not import the ``accelerate`` package.

>>> from app.distributed import Accelerator
>>> accelerator = Accelerator(gradient_accumulation_steps=2)
>>> model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
>>> for batch in loader:
...     with accelerator.accumulate(model):
...         loss = model(batch).loss
...         accelerator.backward(loss)
...         optimizer.step(); scheduler.step(); optimizer.zero_grad()

Where we deliberately differ from Accelerate:
- ``gather_for_metrics`` never silently returns un-deduplicated data (see its docstring);
- no hidden global state: two Accelerators in one process do not share anything (``state.py``
  keeps one reference to the live backend so ``PartialState()`` can answer; nothing else reads it);
- checkpoints are safetensors + JSON with a manifest, never pickle.
Our engine chooses two things explicitly: ``scale_scheduler_by_processes=False`` and a data ``seed``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.hooks import RemovableHandle

from app.distributed.backend import Backend
from app.distributed.checkpoint.background import BackgroundWriter
from app.distributed.checkpoint.export import export_shards, save_model
from app.distributed.checkpoint.rng import preserved_rng
from app.distributed.checkpoint.training_state import (
    Counters,
    TrainingObjects,
    load_state,
    load_weights,
    save_state,
    save_weights,
)
from app.distributed.configuration import (
    AutocastKwargs,
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from app.distributed.connector import connect
from app.distributed.data import DataLoaderShard, GradientState, draw_generator_seed, shard_dataloader
from app.distributed.data import skip_first_batches as _skip_first_batches
from app.distributed.data_stream import ShardedStream, StreamLoaderShard
from app.distributed.functional import pad_with, reduce_with
from app.distributed.hardware.kinds import DistributedType
from app.distributed.hardware.peak_flops import compute_type, peak_flops
from app.distributed.host_reads import HostRead
from app.distributed.operations import recursively_apply
from app.distributed.placeholders import refuse_placeholder
from app.distributed.precision import Precision, unscale_all
from app.distributed.process import ProcessControl
from app.distributed.state import AcceleratorState, register_accelerator
from app.distributed.step_flags import StepFlag
from app.distributed.step_items import StepItems, scale_gradients
from app.distributed.wrappers import AcceleratedOptimizer, AcceleratedScheduler
from app.run_layout import checkpoints_dir

F = TypeVar("F", bound=Callable[..., Any])

_SYNCHRONISING = contextlib.nullcontext()
"""What ``accumulate`` returns when the backward must synchronise as usual (nothing to enter)."""


class Accelerator(ProcessControl):
    backend: Backend
    """What runs the collectives and wraps the model for this hardware kind (``backend.py``)."""

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = False,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        log_with: str | Sequence[str] | None = None,
        even_batches: bool = True,
        step_scheduler_with_optimizer: bool = True,
        rng_types: Sequence[str] | None = None,
        kwargs_handlers: Sequence[Any] | None = None,
        downcast_bf16: bool = False,
        *,
        backend: Backend | None = None,
        seed: int | None = None,
        scale_scheduler_by_processes: bool = True,
    ):
        """Accelerate's constructor arguments, plus three of ours: ``backend`` (a ready backend
        object; by default one is chosen from the environment and ``cpu``), ``seed`` (the data-order
        seed: shuffles from ``seed + epoch``, resumable exactly; by default the prepared loader
        shuffles as the user's sampler does, like Accelerate) and ``scale_scheduler_by_processes``
        (Accelerate steps the LR scheduler once per process per optimizer step unless
        ``split_batches``; False steps it once per optimizer step).

        ``connector.connect`` turns the arguments into what the Accelerator runs with, and refuses
        with one sentence any it cannot honour (``downcast_bf16=True``, ``rng_types`` beyond the
        sampler's generator, an unsupported kwargs handler...)."""
        connected = connect(
            split_batches=split_batches, mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps, cpu=cpu, dataloader_config=dataloader_config,
            project_dir=project_dir, project_config=project_config,
            gradient_accumulation_plugin=gradient_accumulation_plugin, log_with=log_with, even_batches=even_batches,
            rng_types=rng_types, kwargs_handlers=kwargs_handlers, downcast_bf16=downcast_bf16, backend=backend)
        self.backend = connected.backend
        self.precision: Precision = connected.precision
        self.ddp_kwargs = connected.ddp_kwargs
        self.autocast_handler = connected.autocast_handler
        self._profile_handler = connected.profile_handler
        self.gradient_accumulation_plugin = connected.gradient_accumulation_plugin
        self.gradient_accumulation_steps: int = connected.gradient_accumulation_plugin.num_steps or 1
        self.gradient_state = GradientState(connected.gradient_accumulation_plugin)
        self.dataloader_config = connected.dataloader_config
        self.project_configuration = connected.project_configuration
        self.project_dir = connected.project_dir
        self.rng_types = connected.rng_types
        self._log_with = connected.log_with
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.scale_scheduler_by_processes = scale_scheduler_by_processes
        self.trackers: list[Any] = []
        self.step = 0
        """Micro-steps seen by ``accumulate`` (Accelerate's name)."""
        self._micro_step = 0
        self._trigger = False
        self._seed = seed
        self._models: list[nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[Any] = []
        self._custom_objects: list[Any] = []
        self._save_state_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._load_state_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._checkpoint_writer = BackgroundWriter()
        self._step_items = StepItems(self.backend)
        """The items back-propagated in the optimizer step being accumulated (``backward(num_items=...)``)."""
        self._state = AcceleratorState.of(self)
        register_accelerator(self)

    @property
    def state(self) -> AcceleratorState:
        """Accelerate's ``AcceleratorState`` view of this Accelerator."""
        return self._state

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def static_shapes(self) -> bool:
        """True when every step must see the same tensor shapes (XLA): prepared loaders then pad their
        last batch to full size, and a task should pad sequences to a fixed length."""
        return self.backend.static_shapes

    @property
    def shards_the_model(self) -> bool:
        """True where the model's parameters are sharded across processes (FSDP2): every process must
        run each forward pass, generation included."""
        return self.backend.distributed_type == DistributedType.FSDP

    @property
    def fused_optimizers(self) -> bool:
        """Whether torch's fused optimizer kernels (``AdamW(fused=True)``) run on this runtime's
        parameters (CPU and CUDA; not XLA)."""
        return self.backend.fused_optimizers

    @property
    def mixed_precision(self) -> str:
        return self.precision.name

    def peak_flops(self) -> float | None:
        """One device's peak FLOP/s for this run's compute type (bf16/fp16 autocast, else fp32 or TF32
        as ``torch.get_float32_matmul_precision()`` allows), from a table of GPUs and TPUs by the name
        the device reports (``app/distributed/hardware/peak_flops.py``); None where the device is not in
        it (a CPU). The denominator of the training log's ``train/mfu``.

        >>> accelerator.peak_flops()   # on an H100 SXM in bf16
        989400000000000.0
        """
        with warnings.catch_warnings():
            # torch 2.9 warns, once per process, that this getter's TF32 settings will change after 2.9
            # (nothing a user of the run can act on; it was the one Python warning on hardware=tpu's terminal).
            warnings.filterwarnings("ignore", message="Please use the new API settings to control TF32")
            matmul_precision = torch.get_float32_matmul_precision()
        kind = compute_type(self.mixed_precision, matmul_precision)
        return peak_flops(self.backend.ops.device_name(self.device), kind)

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def logging_dir(self) -> Path | None:
        configured = self.project_configuration.logging_dir
        return Path(configured) if configured is not None else self.project_dir

    # -- prepare --------------------------------------------------------------------------------------
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
        when that is the device already: the backend's wrapper needs it there."""
        if evaluation_mode:
            raise ValueError("prepare_model(evaluation_mode=True) is not supported: prepare the model as usual (a "
                             "model without trainable parameters is not wrapped for DDP).")
        place = device_placement if device_placement is not None else self.device_placement
        if not place and any(p.device != self.device for p in model.parameters()):
            raise ValueError(f"device_placement=False: the backend places and wraps the model on {self.device} "
                             "(its data-parallel wrappers need it there); move it there first, or leave device_placement on.")
        if any(model is m or model is self.backend.unwrap_model(m) for m in self._models):
            raise ValueError("this model was already prepared; prepare each model once.")
        if self.num_processes > 1 and self.verify_device_map(model):
            raise ValueError("this model was loaded with a device_map over several devices; it cannot be trained "
                             "on several processes (load it without device_map).")
        wrapped = self.backend.wrap_model(model)
        inner = self.backend.unwrap_model(wrapped)
        # The autocast decision is taken once here, not at every step.
        wrapped_forward = self.precision.wrap_forward(inner.forward, self.autocast_handler)
        if wrapped_forward is not inner.forward:
            inner.forward = wrapped_forward  # type: ignore[method-assign]
        self._models.append(wrapped)
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
            # Each process reads its own part and checkpoints its own position (app/distributed/data_stream.py).
            shard: Any = StreamLoaderShard(data_loader, backend=self.backend, device=device,
                                           state=self.gradient_state, place=place)
        elif iterable or config.dispatch_batches:
            from app.distributed.data_iterable import IterableDataLoaderShard

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
        if isinstance(dataloader, StreamLoaderShard):
            return dataloader.skip_first_batches(num_batches)  # type: ignore[return-value]
        return _skip_first_batches(dataloader, num_batches)

    # -- training step --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, num_items: torch.Tensor | int | None = None, **kwargs: Any) -> None:
        """``loss.backward()`` with the loss divided by the accumulation steps and, for fp16, scaled.

        ``num_items`` (ours, not Accelerate's): ``loss`` is the *sum* of the losses of that many items
        (tokens, samples; an int, or a 0-d tensor on the device, which is never read on the host), and
        the gradients of the optimizer step come out as the mean over all its items: every micro-batch
        of the accumulation window, on every process. At the micro-batch that closes the step
        (``sync_gradients``) the items are summed across processes once and the gradients divided by
        them, before any clipping (``step_items.py``). Use it for every micro-batch of a step, or for none.

        >>> with accelerator.accumulate(model):
        ...     logits = model(batch["input_ids"]).logits[:, :-1]
        ...     targets = batch["labels"][:, 1:]
        ...     loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum")  # -100: ignored
        ...     accelerator.backward(loss, num_items=(targets != -100).sum())
        """
        if num_items is None:
            if self.gradient_accumulation_steps > 1:
                loss = loss / self.gradient_accumulation_steps
            self.precision.backward(loss, **kwargs)
            return
        items, closes_step = self._step_items, self.gradient_state.sync_gradients
        alone = items.empty and closes_step  # the step is this micro-batch: divide the loss, not the gradients
        items.add(num_items)
        if alone:
            self.precision.backward(loss * items.take_scale(), **kwargs)
            return
        self.precision.backward(loss, **kwargs)
        if closes_step:
            scale_gradients(self._gradients(), items.take_scale())

    def _gradients(self) -> list[torch.Tensor]:
        """The gradients the prepared optimizers step with (those of the prepared models when no
        optimizer is prepared)."""
        parameters = ([p for o in self._optimizers for group in o.optimizer.param_groups for p in group["params"]]
                      or [p for model in self._models for p in model.parameters()])
        return [p.grad for p in parameters if p.grad is not None]

    def accumulate(self, *models: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Run one micro-step: gradients are synchronised and the optimizer really steps only every
        ``gradient_accumulation_steps`` micro-steps and at the end of the dataloader.

        The micro-step is counted when this is called (``with`` calls it right before entering), and
        the context is a shared no-op whenever nothing must change during backward: this runs on
        every micro-batch, and a generator-based context manager cost ~4x more to enter and leave."""
        self.step += 1
        state = self.gradient_state
        active = state.active
        if active and active[-1].end_of_dataloader and state.sync_with_dataloader:
            # The epoch's last micro-batch completes an optimizer step (unless the plugin's
            # sync_with_dataloader=False carries the accumulation over into the next epoch).
            self._micro_step = 0
            sync = state.sync_gradients = True
        else:
            self._micro_step += 1
            sync = state.sync_gradients = self._micro_step % self.gradient_accumulation_steps == 0
        # sync_each_batch (GradientAccumulationPlugin): all-reduce every micro-step, step every k.
        if sync or self.backend.num_processes == 1 or state.sync_each_batch:
            return _SYNCHRONISING
        stack = contextlib.ExitStack()
        try:
            for model in models:
                stack.enter_context(self.backend.no_sync(model))
        except BaseException:
            stack.close()
            raise
        return stack

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        with self.backend.no_sync(model):
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Force a gradient synchronisation in the next backward, even inside ``no_sync``.

        >>> with accelerator.no_sync(model):
        ...     loss = model(batch).loss
        ...     with accelerator.trigger_sync_in_backward(model):
        ...         accelerator.backward(loss)
        """
        with self.backend.force_sync(model):
            yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Train on dataloaders whose ranks get different numbers of batches: a rank that runs out
        shadows the others' DDP collectives instead of leaving them waiting (torch's ``Join``).

        ``even_batches`` overrides the prepared dataloaders' setting inside the block (set it to
        False to let ranks really have uneven inputs). Join is enabled only when batches are uneven;
        on one process this is a no-op.

        >>> with accelerator.join_uneven_inputs([model], even_batches=False):
        ...     for batch in loader:
        ...         ...
        """
        if self.num_processes == 1:
            yield
            return
        joinable_kind = self.state.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        if not joinable_kind and self.backend.distributed_type != DistributedType.FSDP:  # FSDP2 refuses, below
            warnings.warn("Joining uneven inputs is only supported for multi-GPU and multi-CPU DDP training; "
                          "join_uneven_inputs does nothing here.", UserWarning, stacklevel=3)
            yield
            return
        mapped = [loader for loader in self._dataloaders if isinstance(loader, DataLoaderShard)]
        if even_batches is not None and len(mapped) < len(self._dataloaders):
            warnings.warn("Overriding even_batches is only supported for map-style datasets, yet some dataloaders "
                          "given were iterable; their batches stay as prepared.", UserWarning, stacklevel=3)
        saved = [(loader, loader.batch_sampler.even_batches) for loader in mapped]
        if even_batches is not None:
            for loader, _ in saved:
                loader.batch_sampler.even_batches = even_batches
        uneven = not (even_batches if even_batches is not None else self.even_batches)
        try:
            with self.backend.join(list(joinables), enable=uneven):
                yield
        finally:
            for loader, value in saved:
                loader.batch_sampler.even_batches = value

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast context (a no-op in full precision); ``autocast_handler``: torch.autocast's
        switches for this block (default: the ``AutocastKwargs`` in ``kwargs_handlers``, if any).

        >>> with accelerator.autocast(AutocastKwargs(enabled=False)):
        ...     loss = exact_fp32_part(outputs)
        """
        return self.precision.autocast(autocast_handler if autocast_handler is not None else self.autocast_handler)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        optimizers = [optimizer] if optimizer is not None else self._optimizers
        unscale_all(self.precision, [getattr(o, "optimizer", o) for o in optimizers])

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (across ranks and shards); returns the norm before clipping."""
        if self.precision.scales_loss:  # called every step: skip the no-op unscale walk otherwise
            self.unscale_gradients()
        return self.backend.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        if self.precision.scales_loss:
            self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- models ---------------------------------------------------------------------------------------
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

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on CPU (gathered from shards under FSDP2; valid on the main process),
        with the unwrapped model's key names."""
        if not unwrap:
            raise ValueError("get_state_dict(unwrap=False) is not supported: it returns the unwrapped model's full "
                             "weights; call model.state_dict() for the wrapper's own keys.")
        return self.backend.full_state_dict(model)

    # -- collectives ----------------------------------------------------------------------------------
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

    # -- profiling ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[Any]:
        """Profile the block with ``torch.profiler``; with ``output_trace_dir`` set, each process writes
        its Chrome trace there as ``profile_<process index>.json``. ``profile_handler``: a
        :class:`~app.distributed.profiling.ProfileKwargs` (else the one given in ``kwargs_handlers``).

        >>> with accelerator.profile(ProfileKwargs(output_trace_dir="trace")) as prof:
        ...     train()
        """
        from app.distributed.profiling import PROFILE_PATTERN_NAME, ProfileKwargs

        handler = profile_handler or self._profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        Path(handler.output_trace_dir).mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(
            str(Path(handler.output_trace_dir) / PROFILE_PATTERN_NAME.format(suffix=self.process_index)))
        self.wait_for_everyone()

    # -- triggers -------------------------------------------------------------------------------------
    def set_trigger(self) -> None:
        """Raise a flag on this process; ``check_trigger`` sees it on every process."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process if any process set the trigger (one all-reduce); then resets it."""
        if self.num_processes == 1:  # nothing to agree on: no tensor, no host read
            fired, self._trigger = self._trigger, False
            return fired
        flag = torch.tensor([1.0 if self._trigger else 0.0], device=self.device)
        if float(self.backend.all_reduce(flag, "max").item()) > 0:
            self._trigger = False
            return True
        return False

    # -- process control ------------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[Any]:
        """Drop references to prepared objects and release cached device memory."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        gc.collect()
        self.backend.free_memory()
        return [None for _ in objects]

    clear = free_memory

    def runtime_report(self) -> str | None:
        """What the device runtime did so far, in one sentence, or None where it has nothing to say
        (XLA: graphs compiled and how long that took, cache loads, executions, CPU fallback ops).

        >>> report = accelerator.runtime_report()
        >>> if report: print(report)
        """
        return self.backend.runtime_report()

    def end_training(self) -> None:
        """Wait for a checkpoint still being written (``save_state(async_save=True)``; its error is raised
        here), close trackers and tear down the process group."""
        try:
            self.wait_for_checkpoint()
        finally:
            for tracker in self.trackers:
                tracker.finish()
            self.trackers = []
            self.backend.shutdown()

    # -- tracking -------------------------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, Any] | None = None) -> None:
        """Start the trackers named in ``log_with`` on the main process (others log nothing). The random
        streams come out as they went in (a tracker's start-up may draw from them, and a run resumed
        from a checkpoint must continue the restored streams exactly)."""
        from app.distributed.tracking import build_trackers

        if not self.is_main_process:
            return
        logging_dir = self.logging_dir if self.logging_dir is not None else Path.cwd()
        with preserved_rng(self.backend):
            self.trackers = build_trackers(self._log_with, project_name, logging_dir, config or {}, init_kwargs or {})

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise KeyError(f"no tracker named {name!r} was started (log_with={self._log_with}).")

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """Log ``values`` at ``step`` to every tracker; ``log_kwargs``: ``{tracker name: arguments}`` for
        that tracker's own log call (wandb's ``commit``, TensorBoard's ``walltime``...).

        >>> accelerator.log({"train/loss": 0.3}, step=10, log_kwargs={"wandb": {"commit": False}})
        """
        if log_kwargs:
            for tracker in self.trackers:
                tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))
            return
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def log_table(self, key: str, rows: list[dict[str, str]], step: int, file: Path) -> None:
        """A small table of text at ``step`` (written to ``file`` already) to every tracker: TensorBoard
        text, a W&B table, an MLflow artifact (``Tracker.log_table``)."""
        for tracker in self.trackers:
            tracker.log_table(key, rows, step, file)

    # -- checkpointing --------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with state_dict/load_state_dict) with the state."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"{type(obj).__name__} has no state_dict/load_state_dict, so it cannot be checkpointed.")
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                   *, metadata: dict[str, Any] | None = None, async_save: bool = False,
                   on_complete: Callable[[Path], None] | None = None) -> Path:
        """Save models, optimizers, schedulers, scaler, dataloader positions, RNG states of every
        rank and registered objects, atomically (see ``app/distributed/checkpoint/``); every
        process must call it. Returns the checkpoint folder.

        Without ``output_dir``: ``<project_dir>/checkpoints/checkpoint_<N>``, N continuing from the
        checkpoints already there. ``metadata`` (step, epoch, config_hash, metric, anything else)
        is recorded in the folder's ``manifest.json``. ``on_complete(folder)`` runs on the main process
        once the checkpoint is complete (and ``total_limit`` rotated), before the save counts as done.

        ``async_save=True``: the state is copied off the device (into host buffers kept for the next
        save: one more copy of the state in host memory) and the call returns; the files are written,
        fsynced and committed on a writer thread while training goes on. The folder exists once
        :meth:`wait_for_checkpoint` returns; the next save, ``load_state`` and ``end_training`` wait
        for it too, and raise its error. Synchronous anyway where that copy would not fit in half the
        available host memory (said once), or on several XLA hosts.

        >>> accelerator = Accelerator(project_dir="runs/exp1")
        >>> accelerator.save_state()                  # runs/exp1/checkpoints/checkpoint_0
        >>> accelerator.save_state(async_save=True)   # checkpoint_1, written while training goes on
        >>> accelerator.wait_for_checkpoint()         # ... complete now
        >>> accelerator.load_state()                  # the newest checkpoint that verifies
        """
        if not safe_serialization:
            raise ValueError("save_state writes safetensors and JSON only (no pickle); safe_serialization=False "
                             "is not supported.")
        with self._models_kept_by(self._save_state_pre_hooks, output_dir, with_weights=True):
            return save_state(self.backend, self._training_objects(), output_dir, self.project_dir,
                              self.project_configuration.total_limit, metadata, writer=self._checkpoint_writer,
                              async_save=async_save, on_complete=on_complete)

    def save_weights(self, model: nn.Module, output_dir: str | os.PathLike[str], *, trainable_only: bool = False,
                     metadata: dict[str, Any] | None = None, async_save: bool = False,
                     on_complete: Callable[[Path], None] | None = None) -> Path:
        """Save ``model``'s weights alone into ``output_dir`` (replacing what is there), committed as a
        checkpoint is: written into a temporary folder, fsynced, listed with their SHA-256 in a
        ``manifest.json`` written last, renamed into place; on FSDP2 each rank writes its shards. No
        optimizer, data position or RNG state: a folder to load weights from (:meth:`load_weights`),
        not to resume training. ``trainable_only`` leaves frozen parameters out (a LoRA model's
        adapters and head are what changes). ``metadata`` (step, epoch, metric, ...) goes to the
        manifest; ``async_save`` and ``on_complete`` as in :meth:`save_state`, whose write in flight
        it waits for first. Every process calls it.

        >>> accelerator.save_weights(model, "runs/exp1/best", trainable_only=True, async_save=True)
        >>> accelerator.load_weights(model, "runs/exp1/best")   # waits for the write, verifies, loads
        """
        return save_weights(self.backend, model, Path(output_dir), self.project_dir, metadata,
                            trainable_only=trainable_only, writer=self._checkpoint_writer, async_save=async_save,
                            on_complete=on_complete)

    def load_weights(self, model: nn.Module, input_dir: str | os.PathLike[str]) -> Any:
        """Load the weights :meth:`save_weights` wrote into a prepared model (a parameter it left out
        keeps its value), once the folder verifies (manifest, sizes, SHA-256); returns its manifest.
        Raises ``CheckpointError`` (one sentence) on every process when it does not verify."""
        self.wait_for_checkpoint()
        return load_weights(self.backend, model, Path(input_dir))

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the checkpoint being written in the background (``save_state(async_save=True)``)
        is complete; returns its folder (None: none was being written). Its error, if the write failed,
        is raised here (``DiskFullError``, ``CheckpointWriteError``: one sentence; nothing of that save
        is committed). Every process calls it.

        >>> accelerator.wait_for_checkpoint()
        """
        return self._checkpoint_writer.wait()

    def _training_objects(self) -> TrainingObjects:
        """What save_state and load_state work on: everything prepared or registered, and the counters."""
        return TrainingObjects(models=list(self._models), optimizers=list(self._optimizers),
                               schedulers=list(self._schedulers), dataloaders=list(self._dataloaders),
                               custom_objects=list(self._custom_objects), precision=self.precision,
                               counters=Counters(self.step, self._micro_step, self._seed))

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs before ``save_state`` writes; a model it removes
        from ``models`` is not saved (``weights`` are their state dicts, to read). Returns a handle
        whose ``remove()`` unregisters it."""
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs before ``load_state`` reads; a model it removes from
        ``models`` is not loaded. Returns a handle whose ``remove()`` unregisters it."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle

    @contextlib.contextmanager
    def _models_kept_by(self, hooks: dict[int, Callable[..., None]], folder: Any, with_weights: bool) -> Iterator[None]:
        if not hooks:
            yield
            return
        models = list(self._models)
        where = str(folder if folder is not None else checkpoints_dir(self.project_dir or Path.cwd()))
        for hook in hooks.values():
            if with_weights:
                hook(models, [self.get_state_dict(m) for m in models], where)
            else:
                hook(models, where)
        everything, self._models = self._models, [m for m in self._models if any(m is k for k in models)]
        try:
            yield
        finally:
            self._models = everything

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Write ``obj`` from the main process: a dict of tensors as safetensors, anything JSON can
        hold as JSON. Nothing is pickled: other objects are refused.

        >>> accelerator.save(accelerator.get_state_dict(model), "weights.safetensors")
        """
        if not self.is_main_process:
            return
        if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in obj.items()}, str(f))
            return
        if safe_serialization:
            raise ValueError(f"Accelerator.save(safe_serialization=True) writes safetensors, which hold a dict of "
                             f"tensors; a {type(obj).__name__} is not one (leave safe_serialization off for JSON data).")
        try:
            text = json.dumps(obj)
        except TypeError as error:
            raise ValueError(f"Accelerator.save writes a dict of tensors (safetensors) or JSON data, never pickle; "
                             f"a {type(obj).__name__} is neither ({error}).") from None
        Path(f).write_text(text)

    def verify_device_map(self, model: nn.Module) -> bool:
        """True when the model was loaded with a ``device_map`` spreading it over several devices."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, *, config_hash: str | None = None) -> Any:
        """Restore what save_state wrote, RNG states last; returns the checkpoint's manifest.

        ``input_dir``: one checkpoint, a ``checkpoints/`` folder or a run folder (then the newest
        checkpoint whose files match their SHA-256 is used); default: the project's checkpoints.
        ``config_hash``: refuse a checkpoint whose manifest records another one. Raises
        ``CheckpointError`` (a ``ConfigError``) when no usable checkpoint is found.

        >>> accelerator.load_state("runs/exp1/checkpoints/checkpoint_3")
        """
        self.wait_for_checkpoint()
        with self._models_kept_by(self._load_state_pre_hooks, input_dir, with_weights=False):
            manifest, counters = load_state(self.backend, self._training_objects(), input_dir, self.project_dir,
                                            config_hash)
        self.step, self._micro_step, self._seed = counters.step, counters.micro_step, counters.seed
        return manifest

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Write the full weights as ``model.safetensors``, or as ``model-0000i-of-0000N.safetensors``
        shards with ``model.safetensors.index.json`` when larger than ``max_shard_size``; every process
        calls it, the main process writes.

        >>> accelerator.save_model(model, "export", max_shard_size="1GB")
        """
        save_model(self.backend, model, save_directory, max_shard_size, safe_serialization)

    def load_model(self, model: nn.Module, folder: str | os.PathLike[str]) -> None:
        """Load the weights of an exported model folder (``save_model``'s: ``model.safetensors``, or
        shards with ``model.safetensors.index.json``) into a prepared model; every process calls it.

        >>> accelerator.load_model(model, "export")
        """
        self.backend.checkpoint_io.load_model(model, Path(folder), "model")

    def model_shards(self, model: nn.Module, where: str | os.PathLike[str],
                     max_shard_size: int | str = "10GB") -> list[dict[str, torch.Tensor]]:
        """The full weights ``save_model`` writes, as files of at most ``max_shard_size`` (name ->
        tensor, the unwrapped model's names), for a caller that writes them itself; every process
        calls it (FSDP2 gathers), the main process gets the shards, the others ``[]``. ``where`` only
        names the destination in a warning."""
        return export_shards(self.backend, model, Path(where), max_shard_size)


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return all(_all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_all_tensors(v) for v in data)
    return False

