"""Reproducible rollouts: the k-th completion of a prompt at a step is a function of (seed, step, the
prompt's global index, k) and the weights, not of the number of processes, the batch split or the other
rows of the batch.

**The randomness** is counter-based: the token at completion position ``t`` of row (seed, step, prompt,
k) is where a uniform ``u`` falls in the cumulative distribution of ``softmax(scores)`` (inverse transform
sampling, exact), ``u`` a hash of (row key, t) computed in integer arithmetic on the logits' device (53
bits). There is no generator state to carry, split or checkpoint: a row draws the same number in any batch,
on any process, after any resume. ``scores`` are the logits processed as Transformers' sampling does
(temperature, then top-k, then top-p: :func:`processed_scores`). One number per row and step, not one per
vocabulary entry as Gumbel-max needs: at a 32k vocabulary the hash per entry cost more than a small model's
forward pass.

**The logits** must then be the same for a row whatever batch it is in. Two things change a row's
logits in the last bits: the shapes it is computed in (the batch's rows and its padded prompt length
decide kernel blocking and reduction lengths) and, with SDPA on CPU, the row's place in the batch.
Measured on a tiny Llama in float32 on CPU: up to ~3e-7 between a batch of 4 and batches of 2 or 1;
bitwise equal with eager attention at a fixed shape (``rows_to`` rows, prompts left-padded to
``pad_to``) in any composition and order. A sampled token changes only where two candidates' noisy
scores lie within that difference (never seen in the tests' thousands of tokens); a fixed shape and
eager attention make the tokens equal by construction. Positions come from the attention mask (a
left-padded row counts from its first real token), so padding shifts nothing.

:func:`generate` runs the loop with a KV cache over left-padded prompts, each row stopping at a stop
token (EOS, end of turn) or after ``max_new_tokens``. At natural shapes it computes less than Transformers'
``generate`` for the same completions: a prompt repeated in consecutive rows (a group's completions) is
prefilled once and its cache shared, and rows that have stopped leave the batch (their cache rows dropped)
once a quarter of it has; at a fixed shape (``pad_to``, ``rows_to``) every row is computed to the end.
"""

from __future__ import annotations

import hashlib
import inspect
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B
"""The multiplier of a 32-bit integer finaliser (products stay below 2**59: no int64 overflow)."""
_HIGH, _LOW = 0x9E3779B1, 0x85EBCA6B
"""Mixed into a row's position hash for the two halves of its 53-bit uniform."""


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _MIX) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _MIX) & _MASK32
    return h ^ (h >> 16)


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn (``task.temperature``, ``task.top_k``, ``task.top_p``)."""

    temperature: float = 1.0
    top_k: int = 0
    """0: no top-k filtering."""
    top_p: float = 1.0
    """1.0: no nucleus filtering."""


def processed_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``(rows, vocabulary)`` float32 scores whose softmax is the sampling distribution: the logits
    divided by the temperature, then outside the top k set to -inf (ties with the k-th kept), then
    outside the nucleus set to -inf (the most likely tokens whose probabilities, summed from the least
    likely one kept so far, exceed ``1 - top_p``; the most likely token always stays): the order and
    the rules of Transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``."""
    scores = logits.float()
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if sampling.top_p < 1.0:
        ascending, order = scores.sort(dim=-1)
        below = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        below[..., -1] = False
        scores = scores.masked_fill(below.scatter(-1, order, below), -torch.inf)
    return scores


def row_keys(seed: int, step: int, prompts: Sequence[int], completions: Sequence[int],
             device: torch.device | None = None) -> torch.Tensor:
    """``(rows, 2)`` int64: each row's 64-bit key (two 32-bit halves) from (seed, step, the prompt's
    global index, the completion's index k among its prompt's)."""
    keys = []
    for prompt, k in zip(prompts, completions, strict=True):
        digest = hashlib.blake2b(struct.pack("<4q", seed, step, prompt, k), digest_size=8).digest()
        keys.append(struct.unpack("<2I", digest))
    return torch.tensor(keys, dtype=torch.int64, device=device).view(-1, 2)


def row_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(rows,)`` float64 uniforms in (0, 1) of 53 random bits, a function of each row's key and its
    completion position only."""
    device = keys.device
    at = _fmix(_fmix(keys[:, 1] ^ (positions.to(device) & _MASK32)) ^ keys[:, 0])
    high, low = _fmix(at ^ _HIGH), _fmix(_fmix(at ^ _LOW) ^ keys[:, 1])
    return ((high >> 5).double() * float(1 << 26) + (low >> 6).double() + 0.5) / float(1 << 53)


def sample_tokens(logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                  sampling: Sampling) -> torch.Tensor:
    """One token per row, drawn from ``softmax(processed_scores)`` by inverting its cumulative distribution
    (summed in float64) at the row's counter-based uniform."""
    probabilities = processed_scores(logits, sampling).softmax(dim=-1)
    cumulative = probabilities.double().cumsum(dim=-1)
    target = row_uniforms(keys, positions) * cumulative[:, -1]  # below the total: never past the last token
    return torch.searchsorted(cumulative, target[:, None], right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)


class Rollout(NamedTuple):
    completion_ids: torch.Tensor
    """``(rows, longest)`` the generated tokens, the stop token included, right-padded with ``pad_id``."""
    completion_mask: torch.Tensor
    """``(rows, longest)`` int64: 1 on each row's generated tokens."""
    truncated: torch.Tensor
    """``(rows,)`` bool: the row reached ``max_new_tokens`` without a stop token."""


def _keyword_of(model: nn.Module, new: str, old: str) -> str | None:
    """The name the model's forward takes an argument by (Transformers renamed some), None if neither."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    base = getattr(inner, "get_base_model", None)  # a peft model passes its keywords on to its base model's
    inner = base() if callable(base) else inner
    parameters = inspect.signature(inner.forward).parameters
    return new if new in parameters else old if old in parameters else None


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], keys: torch.Tensor, sampling: Sampling,
             max_new_tokens: int, stop_ids: Sequence[int], pad_id: int, pad_to: int | None = None,
             rows_to: int | None = None, all_done: Callable[[bool], bool] | None = None) -> Rollout:
    """Complete each prompt (token ids) with its row key (:func:`row_keys`), with a KV cache, left
    padding and positions counted from each row's first token. ``pad_to``: left-pad every prompt to this
    length, ``rows_to``: run this many rows (dummy rows after the real ones), so that the shapes, and
    with them each row's logits, do not depend on the other prompts (see the module's docstring).
    ``all_done``: whether every process's rows are done, given this one's (a model sharded over the
    processes runs each forward pass on all of them, so they decode for as many steps as the longest)."""
    device = next(model.parameters()).device
    rows = len(prompts)
    fixed = pad_to is not None or rows_to is not None
    width = max(len(p) for p in prompts) if pad_to is None else pad_to
    total = rows if rows_to is None else rows_to
    if width < max(len(p) for p in prompts) or total < rows:
        raise ValueError(f"pad_to={pad_to} or rows_to={rows_to} is smaller than the batch")
    padded = [*prompts, *[prompts[0]] * (total - rows)]
    # Each run of equal prompts is prefilled once (natural shapes): ``source`` maps a row to its run's first.
    firsts, runs = [], []
    for i in range(total):
        if fixed or i == 0 or padded[i] != padded[i - 1]:
            firsts.append(i)
        runs.append(len(firsts) - 1)
    source = torch.tensor(runs)
    ids = torch.full((len(firsts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((total, width + max_new_tokens), dtype=torch.int64)
    for j, i in enumerate(firsts):
        ids[j, width - len(padded[i]):] = torch.tensor(padded[i], dtype=torch.int64)
    for i, prompt in enumerate(padded):
        mask[i, width - len(prompt):width] = 1
    ids, mask, source = ids.to(device), mask.to(device), source.to(device)
    keys = torch.cat([keys.to(device), keys[:1].to(device).expand(total - rows, 2)])
    positions = (mask[:, :width].cumsum(dim=1) - 1).clamp(min=0)
    stops = torch.tensor(list(stop_ids), dtype=torch.int64, device=device)
    from transformers import DynamicCache  # generation runs where a Transformers model does

    cache = DynamicCache()
    cache_keyword = _keyword_of(model, "cache", "past_key_values") or "past_key_values"
    keep_keyword = _keyword_of(model, "logits_to_keep", "num_logits_to_keep")
    step_kwargs: dict[str, Any] = {cache_keyword: cache, "use_cache": True}
    if keep_keyword is not None:
        step_kwargs[keep_keyword] = 1  # the prompt's last position only: no (rows, prompt, vocabulary) logits
    first_rows = torch.tensor(firsts, device=device)
    logits = model(input_ids=ids, attention_mask=mask[first_rows, :width], position_ids=positions[first_rows],
                   **step_kwargs).logits[:, -1]
    if len(firsts) < total:
        cache.batch_select_indices(source)
        logits = logits[source]
    completion = torch.full((total, max_new_tokens), pad_id, dtype=torch.int64, device=device)
    alive = torch.arange(total, device=device)
    """The batch's rows, by their place among ``total``: rows that have stopped leave it (natural shapes)."""
    done = torch.zeros(total, dtype=torch.bool, device=device)
    positions = positions[:, -1:]
    steps = 0
    for t in range(max_new_tokens):
        at = torch.full((len(alive),), t, dtype=torch.int64, device=device)
        token = torch.where(done, pad_id, sample_tokens(logits, keys[alive], at, sampling))
        completion[alive, t] = token
        done = done | torch.isin(token, stops)
        steps = t + 1
        rows_done = bool(done[:rows].all())  # the dummy rows of a fixed shape come last; natural shapes have none
        if t + 1 == max_new_tokens or (all_done(rows_done) if all_done is not None else rows_done):
            break
        if not fixed and int(done.sum()) * 4 >= len(alive):  # a quarter stopped: drop them from the batch
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            alive, done, token, positions = alive[keep], done[keep], token[keep], positions[keep]
        mask[alive, width + t] = 1
        positions = positions + 1
        logits = model(input_ids=token[:, None], attention_mask=mask[alive, :width + t + 1], position_ids=positions,
                       **step_kwargs).logits[:, -1]
    completion = completion[:rows, :steps]
    finished = torch.isin(completion, stops)
    # 1 up to and including the first stop token (a row without one: all its tokens)
    before_stop = (finished.long().cumsum(dim=1) - finished.long()) == 0
    completion_mask = before_stop.long()
    return Rollout(completion.masked_fill(~before_stop, pad_id), completion_mask, ~finished.any(dim=1))
