"""Schema of ``task=grpo``: ``task=sft``'s model, data sources, chat template and block size, plus what
makes online reinforcement learning from rewards the user writes (the generation, the rewards, the
advantages, the clipped objective and its aggregation, the reference model of the KL term). Kept free of
torch, transformers and datasets: config composition imports it.

``task.rewards`` is a list of free-form entries (OmegaConf holds them as ``dict[str, Any]``, so the keyword
arguments a reward function takes need no schema of their own); :meth:`GRPOConfig.reward_specs` reads them
into :class:`RewardSpec`, refusing a bad entry in one sentence that names it (``task.rewards[1]``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from app.config import ConfigError
from app.tasks.dpo.config import Reference
from app.tasks.sft.config import Overlong, SFTConfig


class ScaleRewards(str, enum.Enum):
    group = "group"
    """Advantages divided by the standard deviation of their prompt's group (DeepSeekMath's GRPO)."""
    batch = "batch"
    """Divided by the standard deviation of the whole generation batch's rewards (all processes')."""
    none = "none"
    """Not divided: ``r - mean_group(r)`` (Dr. GRPO: dividing favours prompts that are too easy or too hard)."""


class GRPOLoss(str, enum.Enum):
    """How the per-token objective becomes the loss (``app/tasks/grpo/loss.py``); TRL 1.16's names."""

    dapo = "dapo"
    """The sum over every completion token of the optimizer step, divided by their number (all
    micro-batches, all processes): the engine's item-normalised loss, the completion token as item."""
    grpo = "grpo"
    """Each completion's token mean, then the mean over the completions (favours short right answers
    and long wrong ones)."""
    dr_grpo = "dr_grpo"
    """The sum over the tokens divided by completions × ``task.max_completion_length`` (Dr. GRPO)."""
    bnpo = "bnpo"
    """The token mean of each micro-batch, then the mean over the step's micro-batches (TRL's: it
    changes with how the step is split)."""


RESERVED_KEYS = ("_target_", "reward_model", "weight", "name")
"""The keys of a ``task.rewards`` entry that are not keyword arguments of the function."""
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


@dataclass(frozen=True)
class RewardSpec:
    """One ``task.rewards`` entry, read: a function (or class) by dotted path with its keyword
    arguments, or a sequence-classification reward model by folder, its weight in the summed reward and
    its name in the metrics (``train/rewards/<name>/mean``)."""

    name: str
    weight: float = 1.0
    target: str | None = None
    """``module.function`` (or ``module.Class``, instantiated once with ``kwargs``, then called)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The entry's other keys, bound as keyword arguments (a class: its constructor's)."""
    reward_model: str | None = None
    """A ``task=reward_model`` export or any one-label ``AutoModelForSequenceClassification`` folder."""


def read_reward(index: int, entry: Any) -> RewardSpec:
    """``task.rewards[index]`` as a :class:`RewardSpec`, or one sentence saying what is wrong with it."""
    where = f"task.rewards[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be {{_target_: module.function, ...}} or {{reward_model: <folder>}}, "
                          f"got {entry!r}.")
    target, model = entry.get("_target_"), entry.get("reward_model")
    if (target is None) == (model is None):
        raise ConfigError(f"{where} names {'both' if target is not None else 'neither of'} _target_ (a function) "
                          "and reward_model (a folder): give one.")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ConfigError(f"{where}.weight must be a number, got {weight!r}.")
    kwargs = {k: v for k, v in entry.items() if k not in RESERVED_KEYS}
    if model is not None:
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where}.reward_model must be a folder or hub name, got {model!r}.")
        if kwargs:
            raise ConfigError(f"{where} is a reward model, which takes no arguments: remove "
                              f"{', '.join(sorted(kwargs))}.")
        default_name = model.rstrip("/").rsplit("/", 1)[-1]
    else:
        if not isinstance(target, str) or _DOTTED.match(target) is None:
            raise ConfigError(f"{where}._target_ must be a dotted path such as my_rewards.exact_answer, got "
                              f"{target!r}.")
        default_name = target.rsplit(".", 1)[-1]
    name = entry.get("name", default_name)
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"{where}.name must be a non-empty name without '/', got {name!r}.")
    return RewardSpec(name=name, weight=float(weight), target=target, kwargs=kwargs, reward_model=model)


@dataclass
class GRPOConfig(SFTConfig):
    """Online RL of an ``AutoModelForCausalLM``: completions generated for prompts, scored by reward
    functions, learnt with GRPO's clipped objective against group-relative advantages."""

    DATA_NEEDED: ClassVar[str] = "prompts"
    DATA_FILES: ClassVar[str] = "JSON Lines, JSON, parquet... with a prompt column (a message list or a string)"
    UNUSED: ClassVar[dict[str, str]] = {
        **dict.fromkeys(("format", "messages_field", "completion_field", "text_field", "train_on"),
                        "it reads prompts (task.prompt_field) and learns the completions it generates."),
        **dict.fromkeys(("sample_prompts", "max_new_tokens"), "its evaluation generates for every validation prompt "
                        "(task.max_completion_length tokens each)."),
        **dict.fromkeys(("streaming", "eval_documents"), "it reads its prompts whole (no streaming yet)."),
        **dict.fromkeys(("max_prompt_length", "truncation_mode"), "it never cuts a prompt (task.overlong=refuse or "
                        "drop)."),
    }
    """task=sft's keys that prompts to generate for leave without a use."""

    name: str = "grpo"
    packing: bool = False
    """Each row is one prompt and one of its completions (packing is refused)."""
    overlong: Overlong = Overlong.refuse
    """A prompt longer than ``task.block_size - task.max_completion_length`` tokens: ``refuse`` (stop
    before training, naming file and line) or ``drop``."""
    # -- generation --------------------------------------------------------------------------------------
    num_generations: int = 8
    """Completions generated per prompt (the group, G >= 2); ``trainer.batch_size`` counts prompts."""
    max_completion_length: int = 256
    """The most tokens a completion has; it stops earlier at EOS or the end-of-turn token."""
    temperature: float = 1.0
    """Sampling temperature; the log-probabilities of the loss are taken at it too (as TRL does)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1.0: all)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: all)."""
    # -- rewards and advantages --------------------------------------------------------------------------
    rewards: list[dict[str, Any]] = field(default_factory=list)
    """Each ``{_target_: module.function, weight: 1.0, name: ..., **kwargs}`` (TRL's signature
    ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``) or ``{reward_model:
    <folder>, weight: 1.0}``; the reward is the weighted sum, None meaning "no opinion"."""
    scale_rewards: ScaleRewards = ScaleRewards.group
    # -- the objective -----------------------------------------------------------------------------------
    loss_type: GRPOLoss = GRPOLoss.dapo
    epsilon: float = 0.2
    """The ratio to the generation-time probability is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = None
    """null: epsilon (DAPO recommends 0.28)."""
    num_iterations: int = 1
    """Optimizer passes over each generation batch (μ); above 1 the ratio leaves 1 and the clip acts."""
    steps_per_generation: int | None = None
    """Micro-batches one generation batch is cut into (TRL's meaning): each process generates for
    ``steps_per_generation × trainer.batch_size`` prompts at once, then trains on them
    ``num_iterations`` times, slice by slice. null: trainer.gradient_accumulation_steps (one generation
    per optimizer step and iteration); above it, later slices are trained on after optimizer steps
    (off-policy: the ratio to the generation-time probabilities and its clip act)."""
    beta: float = 0.0
    """Weight of the k3 KL estimate to the reference model (0: no KL, and no reference in memory)."""
    reference: Reference = Reference.copy
    """With beta > 0: a frozen copy of the starting weights, or (adapter=lora) the model with its
    adapters disabled."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_length count in no loss (DAPO's overlong filtering)."""

    @property
    def clip_high(self) -> float:
        """The upper clip's epsilon: ``epsilon_high``, else ``epsilon``."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def reward_specs(self) -> list[RewardSpec]:
        """``task.rewards`` read, each entry checked, the names distinct."""
        specs = [read_reward(i, entry) for i, entry in enumerate(self.rewards)]
        seen: dict[str, int] = {}
        for i, spec in enumerate(specs):
            if spec.name in seen:
                raise ConfigError(f"task.rewards[{seen[spec.name]}] and task.rewards[{i}] are both named "
                                  f"{spec.name}: give one of them name: <another>.")
            seen[spec.name] = i
        return specs

    def check(self) -> None:
        super().check()
        if self.num_generations < 2:
            raise ConfigError(f"task.num_generations must be at least 2 (advantages compare a prompt's completions), "
                              f"got {self.num_generations}.")
        if not 1 <= self.max_completion_length < self.block_size:
            raise ConfigError(f"task.max_completion_length must be at least 1 and below task.block_size "
                              f"({self.block_size}, prompt and completion), got {self.max_completion_length}.")
        if self.temperature <= 0:
            raise ConfigError(f"task.temperature must be positive, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"task.top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ConfigError(f"task.top_k must be 0 (off) or a number of tokens, got {self.top_k}.")
        if not 0.0 < self.epsilon < 1.0:
            raise ConfigError(f"task.epsilon must be in (0, 1), got {self.epsilon}.")
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            raise ConfigError(f"task.epsilon_high must be positive (or null: task.epsilon), got {self.epsilon_high}.")
        if self.num_iterations < 1:
            raise ConfigError(f"task.num_iterations must be at least 1, got {self.num_iterations}.")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ConfigError(f"task.steps_per_generation must be at least 1 (or null: trainer.gradient_accumulation_"
                              f"steps), got {self.steps_per_generation}.")
        if self.beta < 0:
            raise ConfigError(f"task.beta must be 0 (no KL term) or positive, got {self.beta}.")
        if self.reference is Reference.precomputed:
            raise ConfigError("task=grpo scores completions generated while training, which cannot be precomputed: "
                              "give task.reference=copy or base.")
        if not self.rewards:
            raise ConfigError("task=grpo needs at least one reward: task.rewards=[{_target_: my_rewards.exact_answer}] "
                              "(or {reward_model: <folder>}).")
        self.reward_specs()
        self.check_unused()  # also for a config given to GRPOTask directly, not through RunConfig.check
        if self.packing:
            raise ConfigError("task=grpo trains one prompt and completion per row: give task.packing=false.")
        if self.overlong is Overlong.truncate:
            raise ConfigError("task=grpo never cuts a prompt: give task.overlong=refuse (stop, naming the prompt) or "
                              "drop (leave it out).")
