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
- the LR scheduler steps once per optimizer step, whatever the number of processes;
- ``gather_for_metrics`` never silently returns un-deduplicated data (see its docstring);
- no hidden global state: two Accelerators in one process do not share anything.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from app.distributed.backend import Backend
from app.distributed.data import DataLoaderShard, GradientState, shard_dataloader
from app.distributed.data import skip_first_batches as _skip_first_batches
from app.distributed.launchers import MIXED_PRECISION_ENV
from app.distributed.operations import recursively_apply
from app.distributed.precision import Precision, build_precision, unscale_all
from app.distributed.wrappers import AcceleratedOptimizer, AcceleratedScheduler

F = TypeVar("F", bound=Callable[..., Any])

_REDUCE_OPS = ("sum", "mean", "max", "min")


def default_backend(cpu: bool) -> Backend:
    """The backend the environment asks for (the hardware kind that ``detects`` it): torchrun's
    variables mean several processes; ``cpu`` keeps off accelerators."""
    from app.config import HardwareConfig, HardwareKind
    from app.distributed.hardware import detect_spec

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    spec = detect_spec(world_size, cpu)
    return spec.build_backend(HardwareConfig(kind=HardwareKind(spec.kind), num_processes=world_size,
                                             collective_timeout_s=600.0))


class Accelerator:
    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = False,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Any = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: Any = None,
        log_with: str | Sequence[str] | None = None,
        even_batches: bool = True,
        step_scheduler_with_optimizer: bool = True,
        rng_types: Sequence[str] | None = None,
        kwargs_handlers: Sequence[Any] | None = None,
        downcast_bf16: bool = False,
        *,
        backend: Backend | None = None,
        seed: int | None = None,
    ):
        """Accelerate's constructor arguments, plus two of ours: ``backend`` (a ready backend object;
        by default one is chosen from the environment and ``cpu``) and ``seed`` (the data-order seed;
        by default drawn from torch's RNG and agreed across ranks).

        ``downcast_bf16`` is accepted so that scripts written for Accelerate's TPU path run unchanged,
        and changes nothing: there it sets the deprecated ``XLA_DOWNCAST_BF16`` variable (every fp32
        tensor stored as bf16), here ``mixed_precision="bf16"`` is always ``torch.autocast`` (bf16
        compute, fp32 weights and optimizer states, on every device)."""
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}.")
        self.backend = backend if backend is not None else default_backend(cpu)
        # Unset: what a launcher asked for (notebook_launcher's mixed_precision, Accelerate's variable).
        mixed_precision = mixed_precision or os.environ.get(MIXED_PRECISION_ENV) or "no"
        self.precision: Precision = build_precision(mixed_precision, self.backend.device)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.downcast_bf16 = downcast_bf16
        self.device_placement = device_placement
        if dataloader_config is not None:
            split_batches = getattr(dataloader_config, "split_batches", split_batches)
            even_batches = getattr(dataloader_config, "even_batches", even_batches)
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        project_dir = project_dir if project_dir is not None else getattr(project_config, "project_dir", None)
        self.project_dir = Path(project_dir) if project_dir is not None else None
        self.gradient_state = GradientState()
        self._micro_step = 0
        self._trigger = False
        self._seed = seed
        self._models: list[nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[DataLoaderShard] = []
        self._custom_objects: list[Any] = []
        self._log_with = [log_with] if isinstance(log_with, str) else list(log_with or [])
        self.trackers: list[Any] = []
        self.step = 0
        """Micro-steps seen by ``accumulate`` (Accelerate's name)."""
        from app.distributed.profiling import ProfileKwargs

        self._profile_handler = next((h for h in kwargs_handlers or [] if isinstance(h, ProfileKwargs)), None)

    # -- topology -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def num_processes(self) -> int:
        return self.backend.num_processes

    @property
    def process_index(self) -> int:
        return self.backend.process_index

    @property
    def local_process_index(self) -> int:
        return self.backend.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.backend.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.backend.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.backend.process_index == self.backend.num_processes - 1

    @property
    def distributed_type(self) -> str:
        return self.backend.distributed_type

    @property
    def use_distributed(self) -> bool:
        return self.backend.num_processes > 1

    @property
    def static_shapes(self) -> bool:
        """True when every step must see the same tensor shapes (XLA): prepared loaders then pad their
        last batch to full size, and a task should pad sequences to a fixed length."""
        return self.backend.static_shapes

    @property
    def mixed_precision(self) -> str:
        return self.precision.name

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    # -- prepare --------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Wrap models, optimizers, dataloaders and schedulers for this runtime; returns them in the
        order given (a single object is returned as itself).

        Models are prepared first, so an optimizer created on the original parameters is re-pointed at
        the parameters the backend produced (FSDP2 replaces them with sharded ones).
        """
        replaced: dict[int, nn.Parameter] = {}
        result: list[Any] = list(args)
        for i, obj in enumerate(args):
            if isinstance(obj, nn.Module):
                old = list(obj.parameters())
                result[i] = self.prepare_model(obj)
                new = list(self.backend.unwrap_model(result[i]).parameters())
                replaced.update({id(o): n for o, n in zip(old, new) if o is not n})
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.Optimizer):
                if replaced:
                    for group in obj.param_groups:
                        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
                result[i] = self.prepare_optimizer(obj)
            elif isinstance(obj, DataLoader):
                result[i] = self.prepare_data_loader(obj)
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                result[i] = self.prepare_scheduler(obj)
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> nn.Module:
        if any(model is m or model is self.backend.unwrap_model(m) for m in self._models):
            raise ValueError("this model was already prepared; prepare each model once.")
        wrapped = self.backend.wrap_model(model)
        inner = self.backend.unwrap_model(wrapped)
        # The autocast decision is taken once here, not at every step.
        wrapped_forward = self.precision.wrap_forward(inner.forward)
        if wrapped_forward is not inner.forward:
            inner.forward = wrapped_forward  # type: ignore[method-assign]
        self._models.append(wrapped)
        return wrapped

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> AcceleratedOptimizer:
        wrapped = AcceleratedOptimizer(optimizer, self.gradient_state, self.precision,
                                       step_end=self.backend.step_end)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> AcceleratedScheduler:
        optimizers = [o for o in self._optimizers if o.optimizer is scheduler.optimizer or o is scheduler.optimizer]
        wrapped = AcceleratedScheduler(scheduler, optimizers or self._optimizers, self.gradient_state,
                                       self.step_scheduler_with_optimizer)
        self._schedulers.append(wrapped)
        return wrapped

    def data_seed(self) -> int:
        """The shuffle seed, identical on every rank."""
        if self._seed is None:
            drawn = int(torch.randint(0, 2**31 - 1, (1,)).item())
            self._seed = int(self.backend.broadcast_object(drawn, src=0))
        return self._seed

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> DataLoaderShard:
        seed = self.data_seed()
        if data_loader.generator is not None:
            seed = data_loader.generator.initial_seed()
        placing = device_placement if device_placement is not None else self.device_placement
        device = self.device if placing else torch.device("cpu")
        shard = shard_dataloader(
            data_loader,
            device=device,
            state=self.gradient_state,
            num_processes=self.num_processes,
            process_index=self.process_index,
            seed=seed,
            even_batches=self.even_batches,
            split_batches=self.split_batches,
            fixed_shapes=self.static_shapes,
            place=self.backend.place_batch if device.type != "cpu" else None,
        )
        self._dataloaders.append(shard)
        return shard

    def skip_first_batches(self, dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard:
        """Resume inside an epoch: the next iteration starts ``num_batches`` batches in, without
        loading the skipped samples."""
        return _skip_first_batches(dataloader, num_batches)

    # -- training step --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with the loss divided by the accumulation steps and, for fp16, scaled."""
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        self.precision.backward(loss, **kwargs)

    def _do_sync(self) -> None:
        state = self.gradient_state
        if state.end_of_dataloader:
            # The epoch's last micro-batch always completes an optimizer step.
            self._micro_step = 0
            state.sync_gradients = True
        else:
            self._micro_step += 1
            state.sync_gradients = self._micro_step % self.gradient_accumulation_steps == 0

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Run one micro-step: gradients are synchronised and the optimizer really steps only every
        ``gradient_accumulation_steps`` micro-steps and at the end of the dataloader."""
        self.step += 1
        self._do_sync()
        if self.gradient_state.sync_gradients or self.num_processes == 1:
            yield
            return
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(self.backend.no_sync(model))
            yield

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
        saved = [(loader, loader.batch_sampler.even_batches) for loader in self._dataloaders]
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

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast context (a no-op in full precision)."""
        return self.precision.autocast()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        optimizers = [optimizer] if optimizer is not None else self._optimizers
        unscale_all(self.precision, [getattr(o, "optimizer", o) for o in optimizers])

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (across ranks and shards); returns the norm before clipping."""
        self.unscale_gradients()
        return self.backend.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- models ---------------------------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        inner = self.backend.unwrap_model(model)
        if not keep_fp32_wrapper:
            forward = inner.forward
            original = getattr(forward, "__wrapped__", None)
            if original is not None:
                inner.forward = original  # type: ignore[method-assign]
        return inner

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on CPU (gathered from shards under FSDP2; valid on the main process)."""
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

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce tensors across processes with ``sum``, ``mean``, ``max`` or ``min``."""
        if reduction not in _REDUCE_OPS:
            raise ValueError(f"reduction must be one of {_REDUCE_OPS}, got {reduction!r}.")
        return recursively_apply(lambda t: self.backend.all_reduce(t, reduction) * scale if scale != 1.0
                                 else self.backend.all_reduce(t, reduction), tensor)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size any process has, so they can be gathered."""

        def pad(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0 or dim >= t.dim():
                return t
            size = torch.tensor([t.shape[dim]], device=t.device)
            max_size = int(self.backend.all_reduce(size, "max").item())
            if max_size == t.shape[dim]:
                return t
            shape = list(t.shape)
            shape[dim] = max_size
            out = t.new_full(shape, pad_index)
            index = [slice(None)] * t.dim()
            index[dim] = slice(max_size - t.shape[dim], max_size) if pad_first else slice(0, t.shape[dim])
            out[tuple(index)] = t
            return out

        return recursively_apply(pad, tensor)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        return recursively_apply(lambda t: self.backend.broadcast(t, from_process), tensor)

    def wait_for_everyone(self) -> None:
        self.backend.barrier()

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
        flag = torch.tensor([1.0 if self._trigger else 0.0], device=self.device)
        if float(self.backend.all_reduce(flag, "max").item()) > 0:
            self._trigger = False
            return True
        return False

    # -- process control ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. to fill a cache), then the others."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def _on(self, condition: Callable[[], bool], function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if condition():
                return function(*args, **kwargs)
            return None

        return wrapper  # type: ignore[return-value]

    def on_main_process(self, function: F) -> F:
        """Decorator: run the function on the main process only."""
        return self._on(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: F) -> F:
        return self._on(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: F) -> F:
        return self._on(lambda: self.is_last_process, function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._on(lambda: self.process_index == process_index, function)

    def on_local_process(self, function: F | None = None, local_process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._on(lambda: self.local_process_index == local_process_index, function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine (on the local main process)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of a list, tuple, dict of lists or tensor.

        Shares differ by at most one element; with ``apply_padding`` the short shares are padded with
        their last element so every process gets the same length (drop the extras after gathering).
        """
        n, i = self.num_processes, self.process_index
        if n == 1:
            yield inputs
            return
        length = len(next(iter(inputs.values()))) if isinstance(inputs, dict) else len(inputs)
        per, extra = divmod(length, n)
        start = i * per + min(i, extra)
        end = start + per + (1 if i < extra else 0)
        target = per + (1 if extra else 0)

        def share(seq: Any) -> Any:
            part = seq[start:end]
            if apply_padding and len(part) < target and length > 0:
                fill = part[-1:] if len(part) else seq[-1:]
                if isinstance(part, torch.Tensor):
                    part = torch.cat([part] + [fill] * (target - len(part)))
                else:
                    part = part + type(part)(fill) * (target - len(part))
            return part

        yield {k: share(v) for k, v in inputs.items()} if isinstance(inputs, dict) else share(inputs)

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

    def end_training(self) -> None:
        """Close trackers and tear down the process group."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.backend.shutdown()

    # -- tracking -------------------------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, Any] | None = None) -> None:
        """Start the trackers named in ``log_with`` on the main process (others log nothing)."""
        from app.distributed.tracking import build_trackers

        if not self.is_main_process:
            return
        logging_dir = self.project_dir if self.project_dir is not None else Path.cwd()
        self.trackers = build_trackers(self._log_with, project_name, logging_dir, config or {}, init_kwargs or {})

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise KeyError(f"no tracker named {name!r} was started (log_with={self._log_with}).")

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        for tracker in self.trackers:
            tracker.log(values, step=step)

    # -- checkpointing --------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with state_dict/load_state_dict) with the state."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"{type(obj).__name__} has no state_dict/load_state_dict, so it cannot be checkpointed.")
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                   *, metadata: dict[str, Any] | None = None) -> Path:
        """Save models, optimizers, schedulers, scaler, dataloader positions, RNG states of every
        rank and registered objects, atomically (see ``app/distributed/checkpointing.py``); every
        process must call it. Returns the checkpoint folder.

        Without ``output_dir``: ``<project_dir>/checkpoints/checkpoint_<N>``, N continuing from the
        checkpoints already there. ``metadata`` (step, epoch, config_hash, metric, anything else)
        is recorded in the folder's ``manifest.json``.

        >>> accelerator = Accelerator(project_dir="runs/exp1")
        >>> accelerator.save_state()                  # runs/exp1/checkpoints/checkpoint_0
        >>> accelerator.load_state()                  # the newest checkpoint that verifies
        """
        if not safe_serialization:
            raise ValueError("save_state writes safetensors and JSON only (no pickle); safe_serialization=False "
                             "is not supported.")
        from app.distributed.checkpointing import save_state

        return save_state(self, output_dir, metadata)

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, *, config_hash: str | None = None) -> Any:
        """Restore what save_state wrote, RNG states last; returns the checkpoint's manifest.

        ``input_dir``: one checkpoint, a ``checkpoints/`` folder or a run folder (then the newest
        checkpoint whose files match their SHA-256 is used); default: the project's checkpoints.
        ``config_hash``: refuse a checkpoint whose manifest records another one. Raises
        ``CheckpointError`` (a ``ConfigError``) when no usable checkpoint is found.

        >>> accelerator.load_state("runs/exp1/checkpoints/checkpoint_3")
        """
        from app.distributed.checkpointing import load_state

        return load_state(self, input_dir, config_hash)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Write the full weights as ``model.safetensors``, or as ``model-0000i-of-0000N.safetensors``
        shards with ``model.safetensors.index.json`` when larger than ``max_shard_size``; every process
        calls it, the main process writes.

        >>> accelerator.save_model(model, "export", max_shard_size="1GB")
        """
        from app.distributed.checkpointing import save_model

        save_model(self, model, save_directory, max_shard_size, safe_serialization)


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return all(_all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_all_tensors(v) for v in data)
    return False

