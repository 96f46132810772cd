"""Schema of ``task=dpo``: ``task=sft``'s model, data sources, chat template and block size, plus what
makes preference tuning (the pair's columns, the objective and its β, the reference model). Kept free of
torch, transformers and datasets: config composition imports it.

``PreferenceConfig`` is what every preference task shares (``task=kto`` too): β, the reference and its
synchronisation, how a prompt is fitted into the block."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from app.config import AdapterKind, ConfigError, RunConfig
from app.tasks.sft.config import Overlong, SFTConfig


class LossType(str, enum.Enum):
    """TRL 1.16's names (``DPOTrainer``'s ``loss_type``; ``simpo`` and ``cpo``: ``CPOTrainer``'s; ``orpo``:
    ``ORPOTrainer``'s); the formulas are the table in ``objectives.py`` and docs/dpo.md. ``m`` is the
    margin ``(π_c - ref_c) - (π_r - ref_r)`` of summed answer log-probabilities."""

    sigmoid = "sigmoid"
    """DPO: ``-log σ(β·m)``; with ``task.label_smoothing`` ε, conservative DPO ``-(1-ε)·log σ(β·m) - ε·log σ(-β·m)``."""
    hinge = "hinge"
    """SLiC: ``max(0, 1 - β·m)``."""
    ipo = "ipo"
    """IPO: ``(m' - 1/(2β))²``, ``m'`` over log-probabilities averaged per answer token."""
    exo_pair = "exo_pair"
    """EXO: the KL from the pair's softmax to ``(1-ε, ε)`` (``task.label_smoothing`` ε > 0)."""
    nca_pair = "nca_pair"
    """NCA: ``-log σ(r_c) - ½·log σ(-r_c) - ½·log σ(-r_r)``, ``r = β·(π - ref)``."""
    robust = "robust"
    """Robust DPO: the sigmoid loss unbiased for a share ε of flipped labels."""
    bco_pair = "bco_pair"
    """BCO on pairs: ``-log σ(r_c) - log σ(-r_r)``."""
    sppo_hard = "sppo_hard"
    """SPPO (hard labels): ``(π_c - ref_c - 1/(2β))² + (π_r - ref_r + 1/(2β))²``."""
    aot = "aot"
    """AOT: the sigmoid loss on the sorted policy margins minus the sorted reference margins of the batch."""
    aot_unpaired = "aot_unpaired"
    """AOT unpaired: the sigmoid loss on the sorted chosen ratios minus the sorted rejected ratios."""
    apo_zero = "apo_zero"
    """APO-zero: ``1 - σ(r_c) + σ(r_r)`` (the chosen answers are better than the model's own)."""
    apo_down = "apo_down"
    """APO-down: ``σ(r_c) + 1 - σ(r_c - r_r)`` (the chosen answers are worse than the model's own)."""
    discopop = "discopop"
    """DiscoPOP: a blend of the logistic and exponential losses of ``β·m``, modulated by ``σ(β·m/τ)``."""
    sigmoid_norm = "sigmoid_norm"
    """The sigmoid loss on log-probabilities averaged per answer token."""
    sft = "sft"
    """The chosen answers' NLL, averaged over the optimizer step's chosen tokens (RPO, MPO: in a list)."""
    simpo = "simpo"
    """SimPO (reference-free): ``-log σ(β·(p̄_c - p̄_r) - γ)``, ``p̄`` averaged per answer token."""
    cpo = "cpo"
    """CPO (reference-free): ``-log σ(β·(π_c - π_r))`` plus ``task.cpo_alpha`` × the chosen answers' NLL."""
    orpo = "orpo"
    """ORPO (reference-free): the chosen sequences' NLL minus ``β·log σ(log-odds ratio)``."""


REFERENCE_FREE = frozenset({LossType.simpo, LossType.cpo, LossType.orpo})
"""Objectives of the policy's log-probabilities alone: no reference model is loaded, and none runs."""
SMOOTHED = frozenset({LossType.sigmoid, LossType.robust, LossType.exo_pair, LossType.aot, LossType.aot_unpaired,
                      LossType.simpo, LossType.cpo})
"""The objectives ``task.label_smoothing`` changes (TRL's, and conservative DPO's sigmoid)."""
BATCH_DEPENDENT = frozenset({LossType.aot, LossType.aot_unpaired})
"""Objectives that compare the pairs of a micro-batch with each other (AOT sorts their margins): their loss
depends on how the optimizer step's batch is split, by definition."""


class Reference(str, enum.Enum):
    copy = "copy"
    """A frozen copy of the starting weights, beside the policy (twice the model's weights in memory)."""
    base = "base"
    """With ``adapter=lora``: the policy with its adapters disabled (peft's ``disable_adapter``); no
    second copy of the weights."""
    precomputed = "precomputed"
    """One pass over the training and evaluation pairs before the first step, with the starting
    weights; the values are saved with every checkpoint, so resume and ``mode=eval`` reuse them."""
    folder = "folder"
    """``task.reference=<folder>``: another model (a folder of a Transformers model, e.g. the SFT model
    when the policy starts elsewhere), frozen beside the policy as a copy is."""


_ROWS = "it reads its own columns (task.prompt_field, task.chosen_field, task.rejected_field...)."
_SAMPLES = "it generates no samples at evaluation yet (task.sample_prompts is task=sft's)."


@dataclass
class PreferenceConfig(SFTConfig):
    """What the preference tasks share: β, the reference model and its synchronisation, the answer's
    columns and how a long prompt is fitted into the block."""

    UNUSED: ClassVar[dict[str, str]] = {
        "format": _ROWS, "text_field": _ROWS, "messages_field": _ROWS,
        "train_on": "it learns from the answers, their end-of-turn token included.",
        "loss_chunk": "it takes each answer's log-probabilities from the whole block's logits (no chunked loss yet).",
        "sample_prompts": _SAMPLES, "max_new_tokens": _SAMPLES,
    }
    """task=sft's keys that preference data leaves without a use."""

    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    beta: float = 0.1
    """How far the policy may move from the reference (larger: closer to it)."""
    reference: str = "copy"
    """``copy``, ``base`` (with ``adapter=lora``), ``precomputed``, or a model folder (``Reference``)."""
    reference_batch_size: int = 8
    """Pairs per forward pass of ``task.reference=precomputed``'s pass."""
    sync_ref_every: int | None = None
    """TR-DPO: every this many optimizer steps the reference moves towards the policy
    (``ref ← α·policy + (1-α)·ref``, α = ``task.sync_ref_alpha``); saved with every checkpoint. null: never."""
    sync_ref_alpha: float = 0.6
    overlong: Overlong = Overlong.truncate
    """A pair with a side longer than ``task.block_size`` tokens: ``truncate`` cuts its prompt (to
    ``task.max_prompt_length``, or when null to half the block) and then its answers at the block's end;
    ``drop`` leaves it out (counted in the log); ``refuse`` stops, naming its file and line."""
    max_prompt_length: int | None = None
    """Cut every prompt (the tokens before the answer) to this many tokens, both sides alike; null: only
    a side longer than the block has its prompt cut (``task.overlong=truncate``)."""

    @property
    def reference_mode(self) -> Reference:
        """``task.reference`` as one of its kinds (a value that names none is a model folder)."""
        value = getattr(self.reference, "value", self.reference)  # the enum itself, given in code
        names = {kind.value for kind in Reference} - {Reference.folder.value}
        return Reference(value) if value in names else Reference.folder

    def check(self) -> None:
        super().check()
        self.check_unused()  # also for a config given to a task directly, not through RunConfig.check
        if self.beta <= 0:
            raise ConfigError(f"task.beta must be positive, got {self.beta}.")
        mode = self.reference_mode
        if mode is Reference.folder and not Path(self.reference).expanduser().is_dir():
            raise ConfigError(f"task.reference={self.reference} is none of copy, base and precomputed, nor a model "
                              "folder.")
        if self.reference_batch_size < 1:
            raise ConfigError(f"task.reference_batch_size must be at least 1, got {self.reference_batch_size}.")
        if self.sync_ref_every is not None:
            if self.sync_ref_every < 1 or not 0.0 < self.sync_ref_alpha <= 1.0:
                raise ConfigError(f"task.sync_ref_every must be at least 1 and task.sync_ref_alpha in (0, 1], got "
                                  f"{self.sync_ref_every} and {self.sync_ref_alpha}.")
            if mode in (Reference.base, Reference.precomputed):
                raise ConfigError(f"task.sync_ref_every moves a reference model towards the policy, and task.reference="
                                  f"{mode.value} has none to move; give task.reference=copy or a model folder.")
        if self.packing and self.streaming:
            raise ConfigError(f"task={self.name} packs the rows of a map-style dataset; with task.streaming=true give "
                              "task.packing=false.")

    def check_in_run(self, run: RunConfig) -> None:
        if self.reference_mode is Reference.base and run.adapter.kind is not AdapterKind.lora:
            raise ConfigError("task.reference=base is the model with its LoRA adapters disabled, and this run has "
                              "none: give adapter=lora, or task.reference=copy, precomputed or a model folder.")

    def keys_scaling(self, metric: str) -> tuple[str, ...]:
        # The loss is a function of beta times the log-ratios (or of the margin against 1/(2 beta), ipo), shaped
        # by the loss type and label smoothing; the rewards are beta times log-ratios; ipo averages log-probabilities
        # per token.
        scaling = {"eval/loss": ("task.beta", "task.loss_type", "task.label_smoothing"),
                   "eval/rewards/chosen": ("task.beta", "task.loss_type"),
                   "eval/rewards/rejected": ("task.beta", "task.loss_type"),
                   "eval/rewards/margins": ("task.beta", "task.loss_type")}
        keys = scaling.get(metric, ("task.loss_type",) if metric.startswith("eval/logps/") else ())
        return tuple(key for key in keys if hasattr(self, key.removeprefix("task.")))

    def comparable_metric(self) -> str | None:
        return "eval/rewards/accuracies"


@dataclass
class DPOConfig(PreferenceConfig):
    """Preference tuning of an ``AutoModelForCausalLM`` on prompt/chosen/rejected pairs."""

    DATA_NEEDED: ClassVar[str] = "preference pairs"
    DATA_FILES: ClassVar[str] = "JSON Lines, JSON, parquet... of prompt/chosen/rejected"
    UNUSED: ClassVar[dict[str, str]] = {**PreferenceConfig.UNUSED, "completion_field": _ROWS}

    name: str = "dpo"
    loss_type: Any = "sigmoid"
    """A ``LossType`` name, or a list of them summed with ``task.loss_weights`` (MPO:
    ``[sigmoid,bco_pair,sft]``; RPO: ``[sigmoid,sft]``)."""
    loss_weights: list[float] | None = None
    """One weight per ``task.loss_type`` entry; null: 1 each."""
    label_smoothing: float = 0.0
    """ε: the share of pairs assumed mislabelled (sigmoid, robust, aot, aot_unpaired, simpo, cpo) or EXO's
    target (exo_pair, which needs it above 0)."""
    use_weighting: bool = False
    """WPO: each pair's loss weighted by the policy's probabilities of its two answers (per token, aligned
    by ``log Σ p²``; detached)."""
    ld_alpha: float | None = None
    """LD-DPO: the answer tokens past the shorter answer's length count α times in the log-probabilities
    (policy's and reference's); null: all count once."""
    discopop_tau: float = 0.05
    """DiscoPOP's temperature τ."""
    simpo_gamma: float = 0.5
    """SimPO's target margin γ."""
    cpo_alpha: float | None = None
    """The NLL term's weight of ``cpo`` (null: 1) and ``simpo`` (null: 0, plain SimPO)."""

    def objectives(self) -> tuple[LossType, ...]:
        """``task.loss_type`` as a tuple of loss types (one or more)."""
        names = self.loss_type if isinstance(self.loss_type, (list, tuple)) else [self.loss_type]
        known = ", ".join(kind.value for kind in LossType)
        if not names:
            raise ConfigError(f"task.loss_type is an empty list; give one or more of {known}.")
        unknown = [str(name) for name in names if str(getattr(name, "value", name)) not in
                   {kind.value for kind in LossType}]
        if unknown:
            raise ConfigError(f"task.loss_type has {', '.join(unknown)}, which is not one of {known}.")
        return tuple(LossType(getattr(name, "value", name)) for name in names)

    def weights(self) -> tuple[float, ...]:
        """One weight per objective (``task.loss_weights``, or 1 each)."""
        return tuple(float(w) for w in self.loss_weights) if self.loss_weights is not None \
            else (1.0,) * len(self.objectives())

    @property
    def reference_free(self) -> bool:
        """No reference model at all: the objective reads the policy's log-probabilities alone."""
        return bool(set(self.objectives()) & REFERENCE_FREE)

    @property
    def batch_dependent(self) -> tuple[LossType, ...]:
        return tuple(kind for kind in self.objectives() if kind in BATCH_DEPENDENT)

    def check(self) -> None:
        super().check()
        kinds = self.objectives()
        said = ",".join(kind.value for kind in kinds)
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"task.loss_type=[{said}] names a loss twice.")
        if self.loss_weights is not None and len(self.loss_weights) != len(kinds):
            raise ConfigError(f"task.loss_weights has {len(self.loss_weights)} weight(s) for the {len(kinds)} "
                              f"loss(es) of task.loss_type=[{said}]; give one each.")
        free = [kind for kind in kinds if kind in REFERENCE_FREE]
        if free and len(kinds) > 1:
            raise ConfigError(f"task.loss_type={free[0].value} is reference-free and stands alone (its NLL term "
                              "included), not in a list with other losses.")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"task.label_smoothing must be in [0, 0.5), got {self.label_smoothing}.")
        if self.label_smoothing and not set(kinds) & SMOOTHED:
            raise ConfigError(f"task.label_smoothing applies to {', '.join(k.value for k in sorted(SMOOTHED))}, "
                              f"not to task.loss_type={said}.")
        if LossType.exo_pair in kinds and self.label_smoothing == 0.0:
            raise ConfigError("task.loss_type=exo_pair needs task.label_smoothing above 0 (EXO's ε; its paper "
                              "suggests 1e-3).")
        if self.use_weighting and set(kinds) & BATCH_DEPENDENT:
            raise ConfigError("task.use_weighting weights each pair, and aot and aot_unpaired sort the batch's pairs "
                              "apart: they cannot be used together.")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ConfigError(f"task.ld_alpha must be in [0, 1], got {self.ld_alpha}.")
        if free and (self.ld_alpha is not None or self.use_weighting):
            raise ConfigError(f"task.ld_alpha and task.use_weighting weight the DPO family's log-probabilities, not "
                              f"task.loss_type={free[0].value}'s.")
        if self.discopop_tau <= 0:
            raise ConfigError(f"task.discopop_tau must be positive, got {self.discopop_tau}.")
        if self.cpo_alpha is not None and (self.cpo_alpha < 0 or not set(kinds) & {LossType.cpo, LossType.simpo}):
            raise ConfigError("task.cpo_alpha is the NLL weight of task.loss_type=cpo or simpo, 0 or more.")
        if free and (self.sync_ref_every is not None or self.reference_mode is not Reference.copy):
            raise ConfigError(f"task.loss_type={free[0].value} is reference-free: leave task.reference and "
                              "task.sync_ref_every at their defaults (no reference model is loaded).")
