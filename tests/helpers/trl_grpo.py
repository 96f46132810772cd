"""TRL 1.16's ``GRPOTrainer`` methods driven without a trainer (the test-only reference of ``task=grpo``):
``_generate_and_score_completions`` (rewards, advantages, reward metrics) with the generation replaced
by given token ids, and ``_compute_loss`` (the objective, its aggregation, its metrics) with the
log-probabilities given. Each method is called unbound on a namespace holding only the attributes it
reads, so what is compared is TRL's own code, on one process."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from app.tasks.grpo.config import GRPOLoss, ScaleRewards


class _OneProcess(SimpleNamespace):
    """The accelerator as TRL's methods use it on one CPU process."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"), num_processes=1, process_index=0, is_main_process=True)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


def _trainer(**values: Any) -> SimpleNamespace:
    from trl.trainer.grpo_trainer import GRPOTrainer

    class Namespace(SimpleNamespace):
        pass

    Namespace.__name__ = GRPOTrainer.__name__  # profiling_context names blocks after the class
    for method in ("_calculate_rewards",):
        setattr(Namespace, method, getattr(GRPOTrainer, method))
    return Namespace(accelerator=_OneProcess(), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                     **values)


def trl_scores(completion_ids: Sequence[Sequence[int]], rewards: Sequence[Callable[..., list]],
               weights: Sequence[float], num_generations: int, scale: ScaleRewards,
               eos_id: int = 0, pad_id: int = 0) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's advantages and reward metrics for these completions (one per row, the G of a prompt in
    consecutive rows) scored by these reward functions (called by TRL with ``prompts``, ``completions``
    (the ids as strings) and ``completion_ids``)."""
    from trl.trainer import grpo_trainer
    from trl.trainer.grpo_trainer import GRPOTrainer

    rows = len(completion_ids)
    prompts = [f"prompt {i // num_generations}" for i in range(rows)]
    texts = [" ".join(map(str, ids)) for ids in completion_ids]

    def generated(batch_prompts: list) -> tuple:
        return ([[1, 2]] * rows, [list(ids) for ids in completion_ids], None, texts, None, None, None, None)

    args = SimpleNamespace(steps_per_generation=1, gradient_accumulation_steps=1, report_to=[],
                           per_device_train_batch_size=len(completion_ids),
                           gradient_checkpointing_kwargs=None)
    trainer = _trainer(
        args=args, environment_factories=None, environments=None, tools=None, _generate=generated,
        _tokenizer=SimpleNamespace(pad_token_id=pad_id), pad_to_multiple_of=None, mask_truncated_completions=False,
        eos_token_ids=[eos_id], model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        num_iterations=1, use_vllm=False, vllm_importance_sampling_correction=False, beta=0.0,
        reward_funcs=list(rewards), reward_processing_classes=[None] * len(rewards),
        reward_func_names=[f.__name__ for f in rewards], reward_weights=torch.tensor(weights, dtype=torch.float32),
        state=SimpleNamespace(global_step=0), _log_completion_extra=lambda *a: None, _log_metric=lambda *a: None,
        num_generations=num_generations, num_generations_eval=num_generations,
        multi_objective_aggregation="sum_then_normalize", scale_rewards=scale.value,
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list)},
        _pending_extra_logs=defaultdict(list), _pending_metrics=defaultdict(list), log_multimodal=False)
    # TRL warns of an unscored completion through accelerate's logger, which needs accelerate's state
    with mock.patch.object(grpo_trainer, "logger", logging.getLogger(grpo_trainer.__name__)):
        output = GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": p} for p in prompts])
    return output["advantages"], {k: v[-1] for k, v in trainer._metrics["train"].items()}


def trl_loss(logps: torch.Tensor, inputs: dict[str, torch.Tensor], loss_type: GRPOLoss, epsilon: float,
             epsilon_high: float, beta: float, max_completion_length: int, accumulation_steps: int,
             entropies: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's loss of one micro-batch (already divided as TRL divides it for ``accumulation_steps``
    micro-batches per optimizer step, ``steps_per_generation`` equal to it) and its metrics; ``logps``
    stands for the model's per-token log-probabilities, ``inputs`` holds ``completion_mask``,
    ``advantages``, ``num_items_in_batch`` and optionally ``old_per_token_logps`` / ``ref_per_token_logps``."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    rows, length = logps.shape
    entropies = torch.zeros_like(logps) if entropies is None else entropies
    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation_steps)
    trainer = _trainer(
        args=args, _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        top_entropy_quantile=1.0, aux_loss_enabled=False, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type.value, epsilon_low=epsilon,
        epsilon_high=epsilon_high, use_vllm=False, vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=accumulation_steps,
        max_completion_length=max_completion_length, _entropy_bonus_enabled=False)
    batch = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.int64),
             "prompt_mask": torch.ones(rows, 1, dtype=torch.int64),
             "completion_ids": torch.zeros(rows, length, dtype=torch.int64), **inputs}
    loss = GRPOTrainer._compute_loss(trainer, None, batch)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}
