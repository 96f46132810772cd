"""The Accelerator's verbs inside a training step: ``backward`` (loss scaling, accumulation, item
normalisation), ``accumulate`` and the gradient synchronisation switches, ``autocast``, unscaling and
clipping."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from app.distributed.configuration import AutocastKwargs
from app.distributed.data.map_style import DataLoaderShard
from app.distributed.facade.fields import AcceleratorFields
from app.distributed.facade.step_items import scale_gradients
from app.distributed.hardware.kinds import DistributedType
from app.distributed.precision import unscale_all

_SYNCHRONISING = contextlib.nullcontext()
"""What ``accumulate`` returns when the backward must synchronise as usual (nothing to enter)."""


class TrainingStep(AcceleratorFields):
    """``Accelerator``'s training-step verbs (a mixin)."""

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
