"""``Accelerator``: the public runtime API, with the names and semantics documented by Hugging Face
Accelerate, built on our own backends (``app/distributed/backends/``) and precision objects
(``precision.py``). It does not import the ``accelerate`` package.

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
import gc
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from app.distributed.backends.base import Backend
from app.distributed.checkpoint.background import BackgroundWriter
from app.distributed.checkpoint.rng import preserved_rng
from app.distributed.configuration import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from app.distributed.connector import connect
from app.distributed.facade.collectives import Collectives
from app.distributed.facade.prepare import Preparing
from app.distributed.facade.saving import Saving
from app.distributed.facade.step_items import StepItems
from app.distributed.facade.training_step import TrainingStep
from app.distributed.hardware.peak_flops import compute_type, peak_flops
from app.distributed.state import AcceleratorState, GradientState, register_accelerator


class Accelerator(Preparing, TrainingStep, Collectives, Saving):
    """The runtime API. Its verbs live in ``app/distributed/facade/``, one job a module: ``prepare``
    (wrapping models, optimizers, loaders, schedulers), ``training_step`` (``backward``, ``accumulate``,
    clipping), ``collectives`` (``gather_for_metrics``, ``reduce``...), ``saving`` (``save_state``,
    ``load_state``...), ``process`` (``wait_for_everyone``, ``main_process_first``...); ``fields`` declares
    what an Accelerator holds. Here: the constructor, profiling, triggers, tracking and the end of training."""

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
        self.precision = connected.precision
        self.ddp_kwargs = connected.ddp_kwargs
        self.autocast_handler = connected.autocast_handler
        self._profile_handler = connected.profile_handler
        self.gradient_accumulation_plugin = connected.gradient_accumulation_plugin
        self.gradient_accumulation_steps = connected.gradient_accumulation_plugin.num_steps or 1
        self.gradient_state = GradientState(connected.gradient_accumulation_plugin)
        self.dataloader_config = connected.dataloader_config
        self.project_configuration = connected.project_configuration
        self.project_dir = connected.project_dir
        self.rng_types = connected.rng_types
        self._log_with = connected.log_with
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.scale_scheduler_by_processes = scale_scheduler_by_processes
        self.trackers = []
        self.step = 0
        self._micro_step = 0
        self._trigger = False
        self._seed = seed
        self._models = []
        self._optimizers = []
        self._schedulers = []
        self._dataloaders = []
        self._custom_objects = []
        self._save_state_pre_hooks = OrderedDict()
        self._load_state_pre_hooks = OrderedDict()
        self._checkpoint_writer = BackgroundWriter()
        self._step_items = StepItems(self.backend)
        self._state = AcceleratorState.of(self)
        register_accelerator(self)

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
