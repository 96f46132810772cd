"""``trainer.gradient_checkpointing=true``: keep fewer activations for the backward pass and compute them
again there (less memory, roughly one more forward pass of compute).

- A Transformers model does it itself: ``gradient_checkpointing_enable`` (``activation_checkpointing_enable``
  since Transformers 5) with non-reentrant
  ``torch.utils.checkpoint`` (``use_reentrant=False``: correct with frozen inputs, as under LoRA, and
  with inputs that need no gradient), where its class supports it.
- Any other model, through ``torch.utils.checkpoint`` on the blocks its task declares
  (:class:`app.tasks.base.CheckpointsBlocks`): each block's forward runs under it while training.
- A model that has neither is refused with one sentence, before anything trains.

Dropout draws the same masks in the recomputation (checkpoint restores the random state), so the
losses and gradients are those of a run without it, up to float rounding. Enabled before the model
is wrapped (peft, DDP, FSDP2, compile), on the task's own modules: parameter names, checkpoints and
exports are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from app.config import ConfigError
from app.tasks.base import CheckpointsBlocks, Task


def enable_gradient_checkpointing(model: nn.Module, task: Task) -> str:
    """Turn it on for ``model``; returns how, for the log. ConfigError when the model cannot."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if callable(enable) and getattr(model, "supports_gradient_checkpointing", False):
        # Transformers 5 renamed it activation_checkpointing_enable (the old name warns, until v6).
        renamed = getattr(model, "activation_checkpointing_enable", None)
        if callable(renamed):
            renamed(activation_checkpointing_kwargs={"use_reentrant": False})
            return f"{type(model).__name__}.activation_checkpointing_enable(use_reentrant=False)"
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return f"{type(model).__name__}.gradient_checkpointing_enable(use_reentrant=False)"
    blocks = task.checkpoint_blocks(model) if isinstance(task, CheckpointsBlocks) else []
    if blocks:
        for block in blocks:
            checkpoint_block(block)
        return f"torch.utils.checkpoint on the {len(blocks)} block(s) the task {task.name} declares"
    why = ("its Transformers class does not support gradient checkpointing" if callable(enable)
           else "it is not a Transformers model")
    raise ConfigError(f"trainer.gradient_checkpointing=true cannot recompute the activations of {type(model).__name__}: "
                      f"{why}, and the task {task.name} declares no blocks to checkpoint (checkpoint_blocks); leave "
                      "trainer.gradient_checkpointing=false.")


def checkpoint_block(block: nn.Module) -> None:
    """Run ``block``'s forward under non-reentrant ``torch.utils.checkpoint`` whenever it trains with
    gradients on (evaluation runs it plainly). The forward is replaced on the instance: the block keeps
    its place and its parameters' names."""
    forward: Callable[..., Any] = block.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if block.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    block.forward = checkpointed  # type: ignore[method-assign]
