"""Optimizer parameter groups: which parameters decay, and (optionally) a learning rate per layer.

Weight decay spares biases and normalisation weights (the 0-d and 1-d parameters), as BERT, GPT-2
and the HF Trainer train them: decaying a LayerNorm's scale pulls it towards zero, which is not a
regulariser but a change of the model.

Layer-wise learning-rate decay (``optim.layer_decay``, as ELECTRA and DeBERTa fine-tune): the head
trains at ``optim.lr``, the top block at ``lr * decay``, the block below at ``lr * decay**2``, ..., the
embeddings at ``lr * decay**(blocks + 1)``. Lower layers hold the most general pretrained features
and a small fine-tuning set moves them least usefully; the head is new and needs the full rate.
Blocks are found by name: the number after ``layer.``/``layers.``/``h.``/``blocks.``/``block.``, the
way Transformers and timm models name their stacks.

Freezing (``optim.freeze``): parameters whose names match one of the patterns keep their
pretrained values; they get no gradient, no optimizer state and no weight decay. On a few thousand
examples, fine-tuning a 30k-word embedding table moves only the rows of words that occur in them,
away from the rows of words that do not.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from app.config import ConfigError

_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layer|layers|h|blocks|block)\.(\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)[^.]*embed[^.]*\.")


def parameter_groups(model: nn.Module, weight_decay: float, lr: float | None = None,
                     layer_decay: float | None = None) -> list[dict[str, Any]]:
    """Trainable parameters in optimizer groups; with ``layer_decay`` each group also carries its
    own ``lr`` (the scheduler scales every group's rate by the same factor)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    depth: dict[str, int] = {}
    rate: dict[int, float] = {}  # learning rate per depth, with layer decay
    if layer_decay is not None:
        if lr is None:
            raise ValueError("layer_decay needs the base learning rate")
        depth = layer_depths([name for name, _ in named])
        top = max(depth.values())
        rate = {level: lr * layer_decay ** (top - level) for level in set(depth.values())}
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, param in named:
        decays = bool(weight_decay) and param.ndim >= 2
        level = depth.get(name, 0)
        group = groups.get((level, decays))
        if group is None:
            group = groups[(level, decays)] = {"params": []}
            if weight_decay:
                group["weight_decay"] = weight_decay if decays else 0.0
            if rate:
                group["lr"] = rate[level]
        group["params"].append(param)
    # Deterministic order (depth, then decayed first), so an optimizer state loads into the same groups.
    return [groups[key] for key in sorted(groups, key=lambda k: (k[0], not k[1]))]


def freeze_parameters(model: nn.Module, patterns: list[str]) -> list[str]:
    """Stop training the parameters whose names match one of ``patterns``; returns their names.

    Must run before the model is wrapped (DDP and FSDP2 decide what to synchronise from
    ``requires_grad`` when they wrap it)."""
    parameters = dict(model.named_parameters())
    frozen: dict[str, None] = {}  # an ordered set: model order within a pattern, patterns in turn
    for pattern in patterns:
        matches = [name for name in parameters if re.search(pattern, name)]
        if not matches:
            raise ConfigError(f"optim.freeze pattern {pattern!r} matches none of the model's parameters "
                              f"(they are named like {next(iter(parameters))!r}).")
        frozen.update(dict.fromkeys(matches))
    if frozen and len(frozen) == len(parameters):
        raise ConfigError("optim.freeze matches every parameter of the model, which leaves nothing to train.")
    for name in frozen:
        parameters[name].requires_grad_(False)
    return list(frozen)


def layer_depths(names: list[str]) -> dict[str, int]:
    """Depth of each parameter: 0 for embeddings, 1 + block index for blocks, blocks + 1 for the
    rest (the head, final norms, poolers)."""
    blocks = {name: int(m.group(1)) for name in names if (m := _BLOCK_INDEX.search(name))}
    if not blocks:
        raise ConfigError(
            "optim.layer_decay needs a model built of numbered blocks (parameters named like "
            "'encoder.layer.3.…'), and this model has none; leave optim.layer_decay=null."
        )
    top = max(blocks.values()) + 2
    depths = {}
    for name in names:
        if name in blocks:
            depths[name] = blocks[name] + 1
        elif _EMBEDDING.search(name):
            depths[name] = 0
        else:
            depths[name] = top
    return depths
