"""A cross-entropy that never holds the whole block's vocabulary-sized logits: the model's body runs to
its hidden states as usual, and its output layer (``get_output_embeddings()``, a LoRA-adapted one
included) is applied ``chunk`` positions at a time, each chunk's logits turned into per-position losses
(float32, as :func:`app.tasks.causal_lm.task.token_losses` computes them) and freed; in backward each
chunk's logits are recomputed (``torch.utils.checkpoint``). The loss's memory is the chunk's
``batch x chunk x vocabulary``, not the block's.

How, without reaching past the engine's wrappers (DDP, FSDP2, PEFT): for the duration of one call of
the whole model, the head's ``forward`` returns, instead of the logits, a ``(batch, length, k)`` float32
tensor of per-position values of each chunk's logits and targets (:data:`ChunkValues`): by default
(:func:`cross_entropy_values`) each position's loss (0 where the target is -100) and whether the argmax
is the target; ``task=grpo`` asks for each position's log-probability and entropy at its temperature.
Positions before ``first`` (a prompt the loss does not read) are not given to the head at all. The
wrapper's hooks (DDP's gradient hooks, FSDP2's unsharding) see an ordinary forward. Outside such a call
the head is untouched (generation, export).

:func:`chunking_holds` checks on the built model, before training, that the head's output is what the
model returns (a model that rescales or caps its logits after the head, such as Gemma 2's soft cap,
is run with the plain loss instead).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from app.tasks.causal_lm.batches import IGNORE_INDEX


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t + 1 (the last position predicts nothing)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


ChunkValues = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(a chunk's logits ``(batch, chunk, vocabulary)``, its targets ``(batch, chunk)``, -100 where none) ->
``(batch, chunk, k)`` float32 values per position."""


def cross_entropy_values(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's cross-entropy (0 where the target is -100) and whether the argmax is its target."""
    logits = logits.float()
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none").view_as(targets)
    correct = (logits.detach().argmax(dim=-1) == targets).float()
    return torch.stack([losses, correct], dim=-1)


def _chunk_values(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                  values: ChunkValues = cross_entropy_values) -> torch.Tensor:
    return values(head(hidden), targets)


def recomputed(function: Callable[..., torch.Tensor], head: Callable[[torch.Tensor], torch.Tensor],
               hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``function(head, hidden, targets)``, its activations recomputed in backward. On an XLA device,
    torch_xla's checkpoint: ``torch.utils.checkpoint`` looks for a ``torch.xla`` module to save the RNG
    state (there is none), and torch_xla's puts an optimization barrier before the recomputation, which
    XLA's compiler would otherwise merge back into the forward pass (keeping the logits after all)."""
    kind = hidden.device.type
    if not hasattr(torch, kind):  # a device type torch has no module for brings its checkpoint in torch_<type>
        # (tasks name no device type: only app/distributed/hardware/ does, tests/test_hardware.py)
        own = importlib.import_module(f"torch_{kind}.utils.checkpoint").checkpoint
        return own(function, head, hidden, targets, use_reentrant=True)  # the only kind torch_xla has
    return checkpoint(function, head, hidden, targets, use_reentrant=False)


def chunked_losses(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                   chunk: int, values: ChunkValues = cross_entropy_values, first: int = 0) -> torch.Tensor:
    """``(batch, length, k)``: ``values`` of each position (by default its loss and whether the head's
    argmax is its target), the head applied ``chunk`` positions at a time from position ``first`` (those
    before are zeros) and recomputed in backward when gradients are needed."""
    function = _chunk_values if values is cross_entropy_values else functools.partial(_chunk_values, values=values)
    pieces = []
    for start in range(first, hidden.shape[1], chunk):
        h, t = hidden[:, start:start + chunk], targets[:, start:start + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            pieces.append(recomputed(function, head, h, t))
        else:
            pieces.append(function(head, h, t))
    if first:
        pieces.insert(0, pieces[0].new_zeros(hidden.shape[0], first, pieces[0].shape[-1]))
    return torch.cat(pieces, dim=1)


class _ChunkedForward:
    """Set as the head's ``forward`` (an instance attribute, so the module, its parameters and state
    dict keys stay the same); plain unless :func:`losses_from_head` has given it targets."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor]):
        self.forward = forward
        self.targets: torch.Tensor | None = None
        self.chunk = 0
        self.values: ChunkValues = cross_entropy_values
        self.first = 0

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.targets is None:
            return self.forward(hidden, *args, **kwargs)
        if hidden.shape[:2] != self.targets.shape:
            raise RuntimeError(f"the output layer got hidden states of shape {tuple(hidden.shape)} for targets of "
                               f"shape {tuple(self.targets.shape)}")
        return chunked_losses(self.forward, hidden, self.targets, self.chunk, self.values, self.first)


def output_layer(model: nn.Module) -> nn.Module:
    """The head of ``model`` through DDP's wrapper (PEFT and FSDP2 keep ``get_output_embeddings``)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    head = inner.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Module):
        raise TypeError(f"{type(inner).__name__} has no output embeddings")
    return head


@contextmanager
def losses_from_head(model: nn.Module, labels: torch.Tensor, chunk: int, values: ChunkValues = cross_entropy_values,
                     first: int = 0) -> Iterator[None]:
    """Within: calling ``model`` gives, as its ``logits``, the ``(batch, length, k)`` ``values`` (by default
    the losses and argmax hits) for ``labels`` (shifted here), computed ``chunk`` positions at a time from
    position ``first`` (zeros before it)."""
    head = output_layer(model)
    patched = head.__dict__.get("forward")
    if not isinstance(patched, _ChunkedForward):
        patched = _ChunkedForward(head.forward)
        head.forward = patched  # type: ignore[method-assign]
    patched.targets, patched.chunk, patched.values, patched.first = shifted_targets(labels), chunk, values, first
    try:
        yield
    finally:
        patched.targets, patched.values, patched.first = None, cross_entropy_values, 0


def chunking_holds(model: nn.Module, chunk: int) -> bool:
    """Whether the chunked losses of a short fixed sequence are the plain ones (the model returns its
    head's output as its logits, unchanged)."""
    vocab = model.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    length = 2 * chunk + 3 if chunk < 8 else 11
    ids = ((torch.arange(length) * 7919 + 3) % vocab)[None]
    device = next(model.parameters()).device
    ids = ids.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits.float()
            targets = shifted_targets(ids)
            plain = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="none")
            with losses_from_head(model, ids, min(chunk, 4)):
                chunked = model(input_ids=ids, use_cache=False).logits[..., 0].flatten()
    except Exception:  # noqa: BLE001 - any model the trick does not fit gets the plain loss
        return False
    finally:
        model.train(was_training)
        head = output_layer(model)
        if isinstance(head.__dict__.get("forward"), _ChunkedForward):
            del head.forward  # installed again at the first step, on the head the step's model has (LoRA's)
    return chunked.shape == plain.shape and torch.allclose(chunked, plain, atol=1e-5, rtol=1e-5)
