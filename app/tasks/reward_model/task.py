"""``RewardModelTask``: a reward model trained on preference pairs. ``task=dpo``'s pairs through the
preference tasks' pipeline (``dpo/task.py``'s ``PairTask`` on ``dpo/preference.py``'s ``PreferenceTask``:
explicit or implicit prompts, strings or conversations through the chat template, UltraFeedback's
layout, tools, bad rows refused or skipped, pairs fitted into the block, packed or streamed), with each
pair's ``margin`` read besides, and no reference model; ``task=sft``'s tokenizer, chat template and export; the model a one-label
sequence classifier on the causal LM (``model.py``).

Each batch holds its pairs' chosen rows, then their rejected rows: one forward pass scores both (each
side read at its last real token, padded or packed: ``scores.py``). A pair is one item of the engine's
loss (``StepOutput(sample_losses=per pair, sample_items=1)``; packed, a row's pairs): the loss is the mean
over the pairs of the whole optimizer step, at any batch split. Training logs TRL's ``accuracy``,
``margin`` and ``mean_reward`` over each logging window's pairs; evaluation gathers each pair's values (a
row's sums, minimum and maximum, when packed) and gives TRL's five metrics over the whole set, the minimum
and maximum reward included, and the loss.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.tasks.base import StepOutput, TaskData, TaskRuntime
from app.tasks.causal_lm.models import flops_per_token, model_source
from app.tasks.dpo.packing import PackedPairs, per_row
from app.tasks.dpo.pairs import PairFields, pair_features
from app.tasks.dpo.task import PairTask
from app.tasks.reward_model.config import RewardModelConfig
from app.tasks.reward_model.loss import reward_losses
from app.tasks.reward_model.model import give_padding_token, load_reward_model
from app.tasks.reward_model.predictions import OnePairRows, write_scores
from app.tasks.reward_model.scores import check_scoring, scores_at_every_position, sequence_scores
from app.tasks.sft.attention import check_isolation, model_inputs, use_eager_attention
from app.tasks.sft.records import Places
from app.tasks.sft.spans import TemplateTraits
from app.tasks.text.sources import Split

if TYPE_CHECKING:
    import datasets

EVALUATED = ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward")
"""Each evaluation row's values, gathered (``StepOutput.logits``): per pair, or a packed row's sums of the
first four and its minimum and maximum reward."""


class RewardModelTask(PairTask):
    per_item = ("margin",)
    metric_names: tuple[str, ...] = EVALUATED  # type: ignore[assignment]
    evaluation_sums = None  # type: ignore[assignment]
    """Not a ``SummedMetrics`` task (setting the protocol's method to None says so): the minimum and maximum
    reward are no sums, so evaluation gathers each row's values (:data:`EVALUATED`) instead."""

    def __init__(self, cfg: RewardModelConfig):
        super().__init__(cfg, reference_free=True)
        self.cfg: RewardModelConfig = cfg
        self._padding_given = False
        self._evaluation_pairs: Any = None
        """The evaluation pairs, in order (``task.predict_test``'s scores)."""

    @property
    def tokenizer(self) -> Any:
        tokenizer = super().tokenizer
        if not self._padding_given:  # the end-of-turn token is checked with the template (_check_template)
            self._padding_given = True
            give_padding_token(tokenizer, {"EOS": tokenizer.eos_token_id}, self.cfg.tokenizer or model_source(self.cfg))
        return tokenizer

    def _check_template(self) -> TemplateTraits:
        traits = super()._check_template()
        tokenizer = self.tokenizer
        end = tokenizer.convert_tokens_to_ids(traits.end_of_turn) if traits.end_of_turn is not None else None
        give_padding_token(tokenizer, {"end-of-turn token": end}, self.cfg.tokenizer or model_source(self.cfg))
        return traits

    # -- data ----------------------------------------------------------------------------------------------

    def _fields(self, places: Places) -> PairFields:
        return dataclasses.replace(super()._fields(places), margin=self.cfg.margin_field)

    def _features(self) -> datasets.Features:
        return pair_features(margin=True)

    def _tokenize(self, split: Split, places: Places, name: str, root: Path) -> tuple[datasets.Dataset, str]:
        data, said = super()._tokenize(split, places, name, root)
        with_margin = sum(1 for m in data["margin"] if m)
        if with_margin:
            said += f", {with_margin:,} with a margin ({self.cfg.margin_field!r})"
        return data, said

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        data = super().build_data(runtime)
        if self.cfg.predict_test:  # kept for the scores' file, in the evaluation set's order
            self._evaluation_pairs = data.eval.pairs if isinstance(data.eval, PackedPairs) else data.eval
        return data

    def tokens_in_batch(self, batch: Any) -> torch.Tensor:
        """The batch's tokens, both sides, padding left out (a 0-d tensor on the batch's device)."""
        if "segment" in batch:
            return (batch["segment"] < 2 * batch["pair"].numel()).sum()
        mask = batch.get("attention_mask")
        return mask.sum() if mask is not None else torch.tensor(batch["input_ids"].numel(),
                                                                device=batch["input_ids"].device)

    # -- model and steps -----------------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        model = load_reward_model(self.cfg, self.tokenizer)
        self._flops_per_token = flops_per_token(model, self.cfg.block_size)
        if self._explicit_mask:
            use_eager_attention(model)
        check_scoring(model)
        if self.cfg.packing:
            with scores_at_every_position(model):  # the isolation check compares scores per position
                check_isolation(model, self._explicit_mask)
        return model

    def scores(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """``(2, pairs)``: each pair's chosen score, then its rejected score (float32)."""
        dtype = model.get_input_embeddings().weight.dtype if self._explicit_mask else torch.float32  # type: ignore[operator]
        return sequence_scores(model, model_inputs(batch, self._explicit_mask, dtype), batch).view(2, -1)

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Each pair's loss and TRL's metrics (the engine logs their means over the logging window's pairs); for
        evaluation, each row's :data:`EVALUATED` values. Packed, a row is the engine's sample: its pairs'
        sums, and their count as its items."""
        chosen, rejected = self.scores(model, batch)
        losses, metrics = reward_losses(chosen, rejected, batch["margin"], self.cfg.center_rewards_coefficient)
        pairs = torch.ones_like(losses, dtype=torch.int64)
        with torch.no_grad():
            summed = torch.stack([losses.detach(), *metrics.values()], dim=1)
            low, high = torch.minimum(chosen, rejected).detach(), torch.maximum(chosen, rejected).detach()
            if "pair_row" in batch:
                rows, where = batch["input_ids"].shape[0], batch["pair_row"]
                summed = torch.zeros(rows, summed.shape[1], device=summed.device).index_add_(0, where, summed)
                low = torch.full((rows,), torch.inf, device=low.device).scatter_reduce(0, where, low, "amin")
                high = torch.full((rows,), -torch.inf, device=high.device).scatter_reduce(0, where, high, "amax")
            evaluated = torch.cat([summed, low[:, None], high[:, None]], dim=1)
        if "pair_row" in batch:
            return StepOutput(sample_losses=per_row(losses, batch), sample_items=per_row(pairs, batch),
                              sample_metrics={name: per_row(values, batch) for name, values in metrics.items()},
                              sample_minima={"min_reward": low}, sample_maxima={"max_reward": high},
                              logits=evaluated, labels=per_row(pairs, batch))
        return StepOutput(sample_losses=losses, sample_items=1, sample_metrics=metrics, sample_minima={"min_reward": low},
                          sample_maxima={"max_reward": high}, logits=evaluated, labels=pairs)

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """The evaluation set's metrics from its gathered rows (:data:`EVALUATED`; ``labels``: each row's pairs)."""
        pairs = max(int(labels.sum()), 1)
        sums = logits[:, :4].double().sum(dim=0).tolist()
        return {**{name: total / pairs for name, total in zip(EVALUATED, sums, strict=False)},
                "min_reward": float(logits[:, 4].min()), "max_reward": float(logits[:, 5].max())}

    # -- the evaluation pairs' scores (task.predict_test) ---------------------------------------------------

    def test_dataset(self) -> Any:
        """The evaluation pairs in order, as the evaluation's collate function takes them."""
        return OnePairRows(self._evaluation_pairs) if self.cfg.packing else self._evaluation_pairs

    def predict(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """``(pairs, 2)``: each pair's chosen and rejected score."""
        return self.scores(model, batch).T

    def write_predictions(self, outputs: torch.Tensor, path: str | Path) -> None:
        write_scores(self._evaluation_pairs, outputs, self.tokenizer, path)

    # -- export and card -----------------------------------------------------------------------------------

    def card_facts(self) -> dict[str, str]:
        cfg = self.cfg
        facts = self._card_of_prompts("preference pairs", self.conversational)
        loss = "−log σ(r_chosen − r_rejected" + (f" − margin (column `{cfg.margin_field}`))" if cfg.margin_field else ")")
        if cfg.center_rewards_coefficient:
            loss += f" + {cfg.center_rewards_coefficient:g} · (r_chosen + r_rejected)²"
        facts["trained on"] = f"{loss} per pair (Bradley-Terry)"
        facts["score"] = ("one number per text (a prompt and its answer"
                          + (", formatted by the chat template" if self.conversational else
                             " as plain text, BOS first and EOS last") +
                          "), read at its last token (`logits[:, 0]`); higher is better. Only differences between "
                          "answers to the same prompt are trained: σ(r_a − r_b) is the modelled probability that "
                          "answer a is preferred to answer b")
        return facts
