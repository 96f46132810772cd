"""A sequence's score: the one-label head's output at the sequence's last real token, for padded rows
and for packed ones (several sequences in a row, ``app/tasks/dpo/packing.py``).

A Transformers sequence classifier applies its head (``score``) to every position, then keeps one per
row: the rightmost token that is not its ``pad_token_id``. That cannot serve a packed row, which holds
several sequences. So, for the duration of one call of the whole model (:func:`scores_at_every_position`),
a forward hook on the head returns its scores at every position, laid out so that the model's own pooling
hands them all back: the model's ``logits`` are then ``(rows, length)``, one score per token. The call
goes through the engine's wrappers as an ordinary forward (DDP's gradient hooks, FSDP2's unsharding,
peft's copy of the head that trains), and the head is found through them at each call (``score_head``).
:func:`check_scoring` checks on the built model, before training, that the score at a row's last token
is what the model itself returns for it.

Where a sequence ends: a padded row's real tokens are the first ``attention_mask.sum()`` (right padding;
no mask: all of them); a packed row numbers each token's sequence (``segment``), and a sequence's last
token is the last position with its number.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from app.config import ConfigError

HEAD = "score"
"""The attribute that holds the one-label head of Transformers' sequence classifiers on a causal LM."""


class _EveryPosition:
    """A forward hook on the head: off, it changes nothing; on, it turns the head's ``(rows, length, 1)``
    output into ``(rows, length, length)`` where every position holds the row's scores, so that whichever
    position the model's pooling picks, it returns the whole row (a view: no copy)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not self.on:
            return None
        scores = output[..., 0]
        return scores[:, None, :].expand(-1, scores.shape[1], -1)


def score_head(model: nn.Module) -> nn.Module:
    """The model's one-label head, through DDP's wrapper (peft and FSDP2 keep the attribute; under peft it
    is the wrapper that runs the trained copy of the head)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    head = getattr(inner, HEAD, None)
    if not isinstance(head, nn.Module):
        raise ConfigError(f"{type(inner).__name__} has no {HEAD!r} head: a reward model is a Transformers sequence "
                          "classifier on a causal language model (AutoModelForSequenceClassification), whose head "
                          f"is {HEAD!r}.")
    return head


@contextmanager
def scores_at_every_position(model: nn.Module) -> Iterator[None]:
    """Within: the model's ``logits`` are each row's scores at every position, ``(rows, length)``."""
    head = score_head(model)
    hook = head.__dict__.get("_every_position")
    if not isinstance(hook, _EveryPosition):  # once per head (a deep copy of the model copies it, switched off)
        hook = _EveryPosition()
        head.register_forward_hook(hook)
        head.__dict__["_every_position"] = hook
    hook.on = True
    try:
        yield
    finally:
        hook.on = False


def last_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The flat index (row × length + position) of each sequence's last token, in the batch's order of
    sequences: a padded batch's rows; a packed batch's sequences by number (``segment``: 0 to S-1, S for
    the padding)."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    starts = torch.arange(rows, device=ids.device) * length
    if "segment" in batch:
        segment = batch["segment"].flatten()
        count = int(batch["pair"].numel()) * 2
        positions = torch.arange(rows * length, device=ids.device)
        last = torch.zeros(count + 1, dtype=torch.int64, device=ids.device)
        return last.scatter_reduce(0, segment, positions, reduce="amax")[:count]
    mask = batch.get("attention_mask")
    lengths = mask.sum(dim=1) if mask is not None and mask.dim() == 2 else torch.full_like(starts, length)
    return starts + lengths - 1


def sequence_scores(model: nn.Module, inputs: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's score (float32), in the batch's order of sequences (chosen sides, then rejected):
    ``model(**inputs)`` with the head read at every position, taken at each sequence's last token."""
    with scores_at_every_position(model):
        every = model(**inputs, use_cache=False).logits
    return every.float().flatten()[last_tokens(batch)]


def check_scoring(model: nn.Module) -> None:
    """Refuse a model whose score at a row's last token, read per position, is not what the model itself
    returns for the row (a classifier that pools otherwise, or changes the pooled score)."""
    vocab = model.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    ids = ((torch.arange(9) * 7919 + 3) % vocab)[None]  # fixed tokens: no draw from the run's RNG
    pad = getattr(model.config, "pad_token_id", None)
    ids = torch.where(ids == pad, (ids + 1) % vocab, ids) if isinstance(pad, int) else ids
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            pooled = model(input_ids=ids, use_cache=False).logits.float()
            every = sequence_scores(model, {"input_ids": ids}, {"input_ids": ids})
    finally:
        model.train(was_training)
    if pooled.shape != (1, 1):
        raise ConfigError(f"{type(model).__name__} gives {tuple(pooled.shape)[-1]} scores per sequence; a reward "
                          "model gives one (num_labels=1).")
    if not torch.allclose(every, pooled[:, 0], atol=1e-5, rtol=1e-5):
        raise ConfigError(f"{type(model).__name__} does not return its head's score at the sequence's last token, so "
                          "its scores cannot be read per sequence; a reward model here is a Transformers sequence "
                          "classifier on a causal language model.")
