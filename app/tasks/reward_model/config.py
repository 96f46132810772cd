"""Schema of ``task=reward_model``: the preference tasks' data (``PreferenceConfig``: the pair columns,
fitting and bad-rows policy) and ``task=sft``'s model sources and chat template, plus what makes a reward
model (the margin column, the centring of the rewards, the evaluation pairs' scores). The preference tasks'
β and reference model have no use here (:attr:`RewardModelConfig.UNUSED`). Kept free of torch, transformers
and datasets: config composition imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from app.config import ConfigError
from app.tasks.dpo.config import PreferenceConfig

_NO_POLICY = "a reward model is trained on its own pairs alone (no policy, no reference model, no β)."
_ROWS = "it reads its own columns (task.prompt_field, task.chosen_field, task.rejected_field, task.margin_field)."
_NO_GENERATION = "a reward model generates nothing (it gives one score per sequence)."


@dataclass
class RewardModelConfig(PreferenceConfig):
    """A reward model: ``AutoModelForSequenceClassification`` with one label on a causal language model,
    trained on prompt/chosen/rejected pairs to score the chosen answer above the rejected one
    (Bradley-Terry: ``-log σ(r_c − r_r − margin)``)."""

    DATA_NEEDED: ClassVar[str] = "preference pairs"
    DATA_FILES: ClassVar[str] = "JSON Lines, JSON, parquet... of prompt/chosen/rejected (and a margin)"
    UNUSED: ClassVar[dict[str, str]] = {
        **PreferenceConfig.UNUSED,
        "completion_field": _ROWS,
        "train_on": "a reward model reads each whole sequence, scored at its last token.",
        "loss_chunk": "a reward model computes no vocabulary-sized logits (its head gives one number per token).",
        "sample_prompts": _NO_GENERATION, "max_new_tokens": _NO_GENERATION,
        "beta": _NO_POLICY, "reference": _NO_POLICY, "reference_batch_size": _NO_POLICY,
        "sync_ref_every": _NO_POLICY, "sync_ref_alpha": _NO_POLICY,
    }
    """The keys of task=sft and of the preference tasks that a reward model leaves without a use."""

    name: str = "reward_model"
    margin_field: str = "margin"
    """A column of margins, one number per pair (Llama 2's margin loss, ``-log σ(r_c − r_r − margin)``: how much
    higher the chosen answer should score, e.g. from the strength of the preference); a row without it, or
    null, has 0 (the plain loss), one with anything but a number is a bad row."""
    center_rewards_coefficient: float = 0.0
    """``c`` of ``+ c · mean((r_c + r_r)²)`` over the pairs (Eisenstein et al. 2023, TRL's
    ``center_rewards_coefficient``; 0.01 is common): keeps the rewards centred on 0; 0: off."""
    predict_test: bool = False
    """After training, and with ``mode=eval``: write each evaluation pair's two scores, their difference and
    whether the chosen one is ahead, with the prompt and both answers, to ``<run>/test_predictions.tsv``."""

    def check(self) -> None:
        super().check()
        if self.center_rewards_coefficient < 0:
            raise ConfigError(f"task.center_rewards_coefficient must be 0 (off) or positive, got "
                              f"{self.center_rewards_coefficient}.")
        if not self.margin_field:
            raise ConfigError("task.margin_field must name a column (a file without it is read with no margins).")

    def keys_scaling(self, metric: str) -> tuple[str, ...]:
        # Margins move the loss's target and the scores with it; the centring term adds to the loss and pulls
        # the rewards' location (their mean, min and max) towards 0. Accuracy compares across both.
        if metric in ("eval/loss", "eval/margin"):
            return "task.margin_field", "task.center_rewards_coefficient"
        if metric in ("eval/mean_reward", "eval/min_reward", "eval/max_reward"):
            return ("task.center_rewards_coefficient",)
        return ()

    def comparable_metric(self) -> str | None:
        return "eval/accuracy"
