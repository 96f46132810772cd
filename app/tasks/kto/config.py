"""Schema of ``task=kto``: the preference tasks' fields (β, the reference and its synchronisation, the
prompt's fitting, ``task.chosen_field``/``task.rejected_field`` for paired files) plus the label's column,
the loss and the weights of desirable and undesirable answers. Kept free of torch, transformers and
datasets: config composition imports it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from app.config import ConfigError
from app.tasks.dpo.config import PreferenceConfig


class KTOLoss(str, enum.Enum):
    """TRL 1.16's ``KTOTrainer`` loss types; ``r`` is an answer's ``log π/ref``, z the KL estimate."""

    kto = "kto"
    """KTO: a desirable answer's ``1 - σ(β·(r - z))``, an undesirable one's ``1 - σ(β·(z - r))``."""
    apo_zero_unpaired = "apo_zero_unpaired"
    """APO-zero on unpaired answers: ``1 - σ(β·r)`` and ``σ(β·r)``; no KL estimate."""


@dataclass
class KTOConfig(PreferenceConfig):
    """KTO of an ``AutoModelForCausalLM`` on answers marked desirable or undesirable."""

    DATA_NEEDED: ClassVar[str] = "answers marked good or bad"
    DATA_FILES: ClassVar[str] = "JSON Lines, JSON, parquet... of prompt/completion/label (or prompt/chosen/rejected)"

    name: str = "kto"
    label_field: str = "label"
    """The column that marks an answer desirable (true) or undesirable (false)."""
    loss_type: KTOLoss = KTOLoss.kto
    desirable_weight: float = 1.0
    """λ_D: the weight of a desirable answer's loss."""
    undesirable_weight: float = 1.0
    """λ_U: the weight of an undesirable answer's loss (the start suggests values that balance the data)."""
    packing: bool = False
    """Not used by task=kto: each answer is trained beside its KL sequence, one row each."""

    def check(self) -> None:
        super().check()
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ConfigError(f"task.desirable_weight and task.undesirable_weight must be positive, got "
                              f"{self.desirable_weight} and {self.undesirable_weight}.")
        if self.packing:
            raise ConfigError("task=kto trains each answer beside its mismatched KL sequence, one row each: "
                              "give task.packing=false.")
