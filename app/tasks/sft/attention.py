"""Attention that never crosses a conversation boundary in a packed row.

Two ways, both from the row's ``position_ids`` (restarting at 0 with each conversation):

- **positions alone** (the default): no attention mask is passed, and the model builds the
  block-diagonal causal mask itself (Transformers' packed-sequence detection, for SDPA, eager and
  flex attention; FlashAttention runs its varlen kernel). A 2-D mask, even all ones, would switch
  that detection off: none is ever passed with packed rows.
- **an explicit 4-D mask** (:func:`block_causal_mask`), where shapes are fixed (XLA): the detection
  asks the host whether a row is packed, a sync per step; the 4-D mask is computed on the device.

:func:`check_isolation` runs two short sequences through the built model, packed and apart, before
training: a model whose attention ignores the positions (a custom one) is refused, not trained with
its conversations seeing each other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from app.config import ConfigError


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive (batch, 1, length, length) mask of packed rows: 0 where a token may attend (an
    earlier or the same token of its own conversation), the dtype's lowest value elsewhere."""
    sequence = (position_ids == 0).cumsum(dim=-1)  # which conversation each token is in
    same = sequence[:, :, None] == sequence[:, None, :]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (same & causal)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def use_eager_attention(model: nn.Module) -> None:
    """Where shapes are fixed (XLA): Transformers' eager attention (matmuls and a softmax, which XLA
    compiles as it would SDPA's math). Under bf16, XLA's autocast does not cast SDPA's inputs to one dtype
    (CUDA's and the CPU's do): Llama's rotary embedding leaves the query and key in float32 and the value
    in bf16, and SDPA refuses them; eager attention's matmuls are cast by autocast. Eager attention also
    builds its mask without asking the host whether the padding mask could be dropped."""
    set_attention = getattr(model, "set_attn_implementation", None)
    if callable(set_attention):
        set_attention("eager")


def model_inputs(batch: dict[str, torch.Tensor], explicit_mask: bool, dtype: torch.dtype) -> dict[str, Any]:
    """What the model is called with: a packed batch's positions, with the 4-D mask if ``explicit_mask``."""
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
        if explicit_mask:
            inputs["attention_mask"] = block_causal_mask(batch["position_ids"], dtype)
    return inputs


def check_isolation(model: nn.Module, explicit_mask: bool) -> None:
    """Refuse a model for which a packed conversation's logits depend on the one packed before it."""
    vocab = model.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    first, second = 7, 5
    ids = (torch.arange(first + second) * 7919 + 3) % vocab  # fixed tokens: no draw from the run's RNG
    positions = torch.cat([torch.arange(first), torch.arange(second)])
    dtype = next(model.parameters()).dtype
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = model(**model_inputs({"input_ids": ids[None], "position_ids": positions[None]}, explicit_mask,
                                          dtype), use_cache=False).logits[0, first:]
            alone = model(input_ids=ids[None, first:], use_cache=False).logits[0]
    finally:
        model.train(was_training)
    if not torch.allclose(packed.float(), alone.float(), atol=1e-4, rtol=1e-4):
        raise ConfigError(f"{type(model).__name__} lets a packed conversation attend to the one before it (its "
                          "attention ignores per-conversation position_ids); train with task.packing=false.")
