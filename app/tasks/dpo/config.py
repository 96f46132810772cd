"""Schema of ``task=dpo``: ``task=sft``'s model, data sources, chat template and block size, plus what
makes preference tuning (the pair's columns, the loss and its β, the reference model). Kept free of
torch, transformers and datasets: config composition imports it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from app.config import AdapterKind, ConfigError, RunConfig
from app.tasks.sft.config import Overlong, SFTConfig


class LossType(str, enum.Enum):
    sigmoid = "sigmoid"
    """DPO (Rafailov et al. 2023): ``-log σ(β·margin)`` over summed answer log-probabilities; with
    ``task.label_smoothing`` ε, the conservative DPO of TRL: ``-(1-ε)·log σ(β·m) - ε·log σ(-β·m)``."""
    ipo = "ipo"
    """IPO (Azar et al. 2023): ``(m - 1/(2β))²`` over log-probabilities averaged per answer token (as
    TRL computes it)."""


class Reference(str, enum.Enum):
    copy = "copy"
    """A frozen copy of the starting weights, beside the policy (twice the model's weights in memory)."""
    base = "base"
    """With ``adapter=lora``: the policy with its adapters disabled (peft's ``disable_adapter``); no
    second copy of the weights."""
    precomputed = "precomputed"
    """One pass over the training and evaluation pairs before the first step, with the starting
    weights; the values are saved with every checkpoint, so resume and ``mode=eval`` reuse them."""


_PAIRS = "it reads prompt/chosen/rejected pairs (task.prompt_field, task.chosen_field, task.rejected_field)."
_SAMPLES = "it generates no samples at evaluation yet (task.sample_prompts is task=sft's)."


@dataclass
class DPOConfig(SFTConfig):
    """Preference tuning of an ``AutoModelForCausalLM`` on prompt/chosen/rejected pairs."""

    DATA_NEEDED: ClassVar[str] = "preference pairs"
    DATA_FILES: ClassVar[str] = "JSON Lines, JSON, parquet... of prompt/chosen/rejected"

    UNUSED: ClassVar[dict[str, str]] = {
        "format": _PAIRS, "text_field": _PAIRS, "messages_field": _PAIRS, "completion_field": _PAIRS,
        "train_on": "it learns from each pair's two answers, their end-of-turn token included.",
        "loss_chunk": "it takes each answer's log-probabilities from the whole block's logits (no chunked loss yet).",
        "sample_prompts": _SAMPLES, "max_new_tokens": _SAMPLES,
    }
    """task=sft's keys that preference pairs leave without a use."""

    name: str = "dpo"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    beta: float = 0.1
    """How far the policy may move from the reference (larger: closer to it)."""
    label_smoothing: float = 0.0
    """The share of pairs assumed mislabelled (conservative DPO); sigmoid loss only."""
    loss_type: LossType = LossType.sigmoid
    reference: Reference = Reference.copy
    reference_batch_size: int = 8
    """Pairs per forward pass of ``task.reference=precomputed``'s pass."""
    overlong: Overlong = Overlong.truncate
    """A pair with a side longer than ``task.block_size`` tokens: ``truncate`` cuts its prompt (to
    ``task.max_prompt_length``, or when null to half the block) and then its answers at the block's end;
    ``drop`` leaves it out (counted in the log); ``refuse`` stops, naming its file and line."""
    max_prompt_length: int | None = None
    """Cut every prompt (the tokens before the answer) to this many tokens, both sides alike; null: only
    a side longer than the block has its prompt cut (``task.overlong=truncate``)."""

    def check(self) -> None:
        super().check()
        self.check_unused()  # also for a config given to DPOTask directly, not through RunConfig.check
        if self.beta <= 0:
            raise ConfigError(f"task.beta must be positive, got {self.beta}.")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"task.label_smoothing must be in [0, 0.5), got {self.label_smoothing}.")
        if self.label_smoothing and self.loss_type is not LossType.sigmoid:
            raise ConfigError(f"task.label_smoothing applies to task.loss_type=sigmoid, not {self.loss_type.value}.")
        if self.reference_batch_size < 1:
            raise ConfigError(f"task.reference_batch_size must be at least 1, got {self.reference_batch_size}.")
        if self.packing and self.streaming:
            raise ConfigError("task=dpo packs pairs of a map-style dataset; with task.streaming=true give "
                              "task.packing=false.")

    def check_in_run(self, run: RunConfig) -> None:
        if self.reference is Reference.base and run.adapter.kind is not AdapterKind.lora:
            raise ConfigError("task.reference=base is the model with its LoRA adapters disabled, and this run has "
                              "none: give adapter=lora, or task.reference=copy or precomputed.")

    def keys_scaling(self, metric: str) -> tuple[str, ...]:
        # The loss is a function of beta * margin (sigmoid) or of margin - 1/(2 beta) (ipo), smoothed by
        # label_smoothing; the rewards are beta * log-ratios; ipo averages log-probabilities per token.
        if metric == "eval/loss":
            return "task.beta", "task.loss_type", "task.label_smoothing"
        if metric in ("eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/margins"):
            return "task.beta", "task.loss_type"
        if metric.startswith("eval/logps/"):
            return ("task.loss_type",)
        return ()

    def comparable_metric(self) -> str | None:
        return "eval/rewards/accuracies"
