"""Tasks: data + model + metric. ``build_task`` maps a task config to its task object.

- ``base``: the interface the engine drives (``Task``, ``TaskData``, ``StepOutput``, ``TaskRuntime``).
- ``digits/``: ``task=digits``, scikit-learn's digits, an MLP; ``metrics``: its accuracy and F1 (by
  hand: importing scikit-learn would double a short run's start-up); ``splits``: the stratified
  train/eval split of digits and text classification.
- ``text/``: ``task=text_classification``, a Transformers encoder on any dataset of one or two text
  columns (classes, several classes, or a number); the nine GLUE tasks are its presets
  (``text/glue.py``, ``conf/task/glue_<name>.yaml``).
- ``causal_lm/``: ``task=causal_lm``, a Transformers causal language model on text, packed into blocks,
  map-style or streamed (``task.streaming``) with exact resume.
- ``sft/``: ``task=sft``, instruction tuning on conversations or prompt/completion pairs through a chat
  template, the loss on the assistant's tokens, packing without cross-attention (built on ``causal_lm``).
- ``dpo/``: ``task=dpo``, preference tuning on chosen/rejected pairs (TRL's DPO losses, SimPO, CPO, ORPO),
  the reference model a frozen copy, another model, the LoRA model with its adapters disabled, or values
  precomputed once (built on ``sft``).
- ``kto/``: ``task=kto``, KTO on answers marked good or bad (built on ``dpo``'s parts).
- ``grpo/``: ``task=grpo``, online reinforcement learning from reward functions: completions generated in
  the loop, group-relative advantages, GRPO's clipped objective (built on ``sft`` and ``dpo``'s reference).
- ``reward_model/``: ``task=reward_model``, a one-label sequence classifier on a causal LM trained on
  chosen/rejected pairs (Bradley-Terry), and the scorer that reads its export (built on ``dpo``'s pairs;
  ``grpo``'s ``{reward_model: <folder>}`` rewards score with it).
- ``external``: a task from the user's own package, named by ``_target_`` in a task YAML.

The schemas import nothing heavy, so composing and validating a config stays fast; each task class
(and torch, transformers, datasets with it) is imported only when that task runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config import TaskConfig
from app.tasks.causal_lm.config import CausalLMConfig
from app.tasks.digits.config import DigitsConfig
from app.tasks.dpo.config import DPOConfig
from app.tasks.external import external_task_class
from app.tasks.grpo.config import GRPOConfig
from app.tasks.kto.config import KTOConfig
from app.tasks.reward_model.config import RewardModelConfig
from app.tasks.sft.config import SFTConfig
from app.tasks.text.config import TextClassificationConfig

if TYPE_CHECKING:
    from app.tasks.base import Task

TASK_SCHEMAS: dict[str, type[TaskConfig]] = {
    "digits": DigitsConfig,
    "text_classification": TextClassificationConfig,
    "causal_lm": CausalLMConfig,
    "sft": SFTConfig,
    "dpo": DPOConfig,
    "kto": KTOConfig,
    "grpo": GRPOConfig,
    "reward_model": RewardModelConfig,
}
"""The schemas of our tasks, stored as ``task/<name>_schema`` (the GLUE presets use text_classification's)."""


def build_task(cfg: TaskConfig) -> Task:
    if isinstance(cfg, DigitsConfig):
        from app.tasks.digits.task import DigitsTask

        return DigitsTask(cfg)
    if isinstance(cfg, TextClassificationConfig):
        from app.tasks.text.task import TextClassificationTask

        return TextClassificationTask(cfg)
    if isinstance(cfg, KTOConfig):  # before sft: its schema extends sft's
        from app.tasks.kto.task import KTOTask

        return KTOTask(cfg)
    if isinstance(cfg, RewardModelConfig):  # before sft: its schema extends sft's
        from app.tasks.reward_model.task import RewardModelTask

        return RewardModelTask(cfg)
    if isinstance(cfg, DPOConfig):  # before sft: its schema extends sft's
        from app.tasks.dpo.task import DPOTask

        return DPOTask(cfg)
    if isinstance(cfg, GRPOConfig):  # before sft: its schema extends sft's
        from app.tasks.grpo.task import GRPOTask

        return GRPOTask(cfg)
    if isinstance(cfg, SFTConfig):  # before causal_lm: its schema extends causal_lm's
        from app.tasks.sft.task import SFTTask

        return SFTTask(cfg)
    if isinstance(cfg, CausalLMConfig):
        from app.tasks.causal_lm.task import CausalLMTask

        return CausalLMTask(cfg)
    task_class = external_task_class(cfg)
    if task_class is not None:
        return task_class(cfg)
    raise TypeError(f"no task is registered for config {type(cfg).__name__}")


__all__ = ["TASK_SCHEMAS", "CausalLMConfig", "DPOConfig", "DigitsConfig", "GRPOConfig", "KTOConfig",
           "RewardModelConfig", "SFTConfig", "TextClassificationConfig", "build_task"]
