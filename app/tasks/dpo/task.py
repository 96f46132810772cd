"""``DPOTask``: preference tuning. ``task=sft``'s model, tokenizer, chat template and export, on pairs of
a chosen and a rejected answer to the same prompt; the objective (``task.loss_type``, one of the table in
``objectives.py`` or a weighted list of them) compares the policy's answer log-probabilities with the
reference's (``task.reference``, ``preference.py``), or reads the policy's alone (SimPO, CPO, ORPO: no
reference model at all).

Each batch holds its pairs' chosen rows, then their rejected rows, padded together: one forward pass
gives both, so they see the same weights (and dropout state). With ``task.packing=true`` a row holds
whole pairs, each side a sequence of its own (``packing.py``); a row is then one of the engine's samples,
its loss the sum over its pairs and its items their count. A pair is one item of the engine's loss
(``StepOutput(sample_losses=per pair, sample_items=1)``): the loss is the mean over the pairs of the
whole optimizer step, at any batch split. An NLL term (``sft``, CPO's, ORPO's) is TRL's mean over the
chosen tokens: over the optimizer step's, whose count the engine totals before the step
(``app.tasks.base.ReadsStepTotals``), so it too is the same at any split; only AOT, which sorts the
micro-batch's margins, depends on the split by definition (said at the start). Evaluation sums TRL's
metrics per pair on each process and reduces them (``app.tasks.base.SummedMetrics``): ``eval/loss``,
``eval/rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``,
``logps/chosen``, ``logps/rejected`` (CPO, SimPO, ORPO: ``nll_loss``; ORPO: ``log_odds_ratio``,
``log_odds_chosen``); training logs the same over each logging window's pairs (``train/rewards/chosen``...:
``StepOutput.sample_metrics``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import StepOutput
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.dpo.config import DPOConfig, LossType
from app.tasks.dpo.logps import Sequences, sequence_logps
from app.tasks.dpo.objectives import Terms, metric_names, nll_kind, preference_losses
from app.tasks.dpo.packing import per_row
from app.tasks.dpo.pairs import (
    PairFields,
    bad_pairs,
    conversational,
    encode_pairs,
    pair_features,
)
from app.tasks.dpo.preference import PreferenceTask
from app.tasks.dpo.stream import PairStream, stream_pairs
from app.tasks.sft.bad_rows import Skipped
from app.tasks.sft.records import Places
from app.tasks.text.task import digest

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


class PairTask(PreferenceTask):
    """A task on prompt/chosen/rejected pairs through the preference tasks' pipeline: task=dpo's rows
    (``pairs.py``), which task=reward_model reads too (with a margin per pair)."""

    # -- data: the pairs' rows (the pipeline is PreferenceTask's) -------------------------------------------

    def _fields(self, places: Places) -> PairFields:
        return PairFields.of(self.cfg, places)

    def _encoder(self, fields: Any) -> Callable[..., dict[str, list]]:
        return functools.partial(encode_pairs, tokenizer=self.tokenizer, fields=fields)

    def _features(self) -> datasets.Features:
        return pair_features()

    def _bad_streamed(self, fields: Any) -> Callable[[list[str], list[int]], list[Skipped]]:
        return functools.partial(bad_pairs, tokenizer=self.tokenizer, fields=fields)

    def _stream(self, path: Path, begin: int, fields: Any) -> PairStream:
        return PairStream(path, begin, functools.partial(stream_pairs, encode=self._encoder(fields)),
                          self.cfg.block_size)

    def _check_columns(self, columns: list[str], origin: str) -> None:
        cfg = self.cfg
        missing = [c for c in (cfg.chosen_field, cfg.rejected_field) if c not in columns]
        if missing:
            raise ConfigError(f"{origin} has no {' or '.join(repr(c) for c in missing)} column (it has "
                              f"{', '.join(columns)}); task={cfg.name} reads prompt/chosen/rejected pairs: set "
                              "task.prompt_field, task.chosen_field and task.rejected_field.")

    def _conversational(self, record: dict[str, Any]) -> bool:
        return conversational(record, self.cfg.prompt_field, self.cfg.chosen_field)


class DPOTask(PairTask):
    def __init__(self, cfg: DPOConfig):
        super().__init__(cfg, reference_free=cfg.reference_free)
        self.cfg: DPOConfig = cfg
        self.objectives, self.weights = cfg.objectives(), cfg.weights()
        self.metric_names = ("loss", *metric_names(self.objectives[0]))  # type: ignore[assignment]
        self.nll = nll_kind(self.objectives, self._cpo_alpha)
        """The NLL an objective reads (``answer``, ``whole``), None for none."""
        self._step_scale: torch.Tensor | None = None
        """The optimizer step's pairs over its NLL tokens (``begin_step``); None: the batch's own."""

    @property
    def _cpo_alpha(self) -> float:
        alpha = self.cfg.cpo_alpha
        return alpha if alpha is not None else 1.0 if LossType.cpo in self.objectives else 0.0

    # -- data -------------------------------------------------------------------------------------------

    def _reference_key(self, key: str) -> str:
        return key if self.cfg.ld_alpha is None else digest(key, f"ld_alpha={self.cfg.ld_alpha}")

    def _said_at_start(self) -> None:
        for kind in self.cfg.batch_dependent:
            log.info("task.loss_type=%s compares the pairs of each micro-batch with each other (it sorts their "
                     "margins): its loss depends on how the optimizer step's batch is split, by definition", kind.value)

    # -- steps -------------------------------------------------------------------------------------------

    def _sequences(self, model: nn.Module, batch: Any, policy: bool = True) -> Sequences:
        """Each side's log-probabilities, chosen sides first (packed or not); for the policy, what the
        objectives read besides (WPO's aligned means, ORPO's whole sequences)."""
        logits = self._logits(model, batch)
        packed = "segment" in batch
        whole = policy and self.nll == "whole"
        real = batch.get("attention_mask") if whole and not packed else None
        return sequence_logps(logits, batch["labels"], batch.get("segment"), 2 * len(batch["pair"]) if packed else None,
                              ld_alpha=self.cfg.ld_alpha, weighting=policy and self.cfg.use_weighting,
                              input_ids=batch["input_ids"] if whole else None, real=real)

    def _reference_logps(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self._sequences(model, batch, policy=False).logps

    def _pairs(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per pair: the loss and TRL's metrics (one forward of the policy over both sides)."""
        found = self._sequences(model, batch)
        policy = found.logps.view(2, -1)
        if self.reference_free:
            reference = torch.zeros_like(policy)
        else:
            assert self.reference is not None  # build_data / build_model chose it
            reference = self.reference(model, batch, self._reference_logps).view(2, -1).to(policy.dtype)
        cfg = self.cfg
        terms = Terms(policy, reference, found.lengths.view(2, -1), self._nll(found, batch, model.training), cfg.beta,
                      cfg.label_smoothing, cfg.discopop_tau, cfg.simpo_gamma, self._cpo_alpha)
        weights = None
        if found.aligned is not None:  # WPO: each pair weighted by its two answers' probabilities
            weights = torch.exp(found.aligned.view(2, -1)).prod(dim=0)
        return preference_losses(terms, self.objectives, self.weights, weights)

    def _nll(self, found: Sequences, batch: Any, training: bool) -> torch.Tensor:
        """Per pair, the chosen side's NLL scaled by the optimizer step's pairs over its NLL tokens
        (training; :meth:`begin_step`) or the batch's own (evaluation, or a step without totals), so that
        the mean over the pairs is TRL's mean over the chosen tokens; zeros when no objective reads it."""
        pairs = len(batch["pair"])
        if self.nll is None:
            return found.logps.new_zeros(pairs)
        if self.nll == "whole":
            assert found.whole is not None and found.whole_lengths is not None
            nll, tokens = -found.whole[:pairs], found.whole_lengths[:pairs]
        else:
            nll, tokens = -found.plain[:pairs], found.lengths[:pairs]
        scale = self._step_scale if training and self._step_scale is not None else pairs / tokens.sum().clamp(min=1)
        return nll * scale

    @property
    def reads_step_totals(self) -> bool:
        return self.nll is not None

    def step_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per sample (a row, packed), its pairs and their chosen NLL tokens (from the labels: no forward)."""
        pairs = len(batch["pair"])
        labels = batch["labels"]
        tokens = sequence_counts(labels, batch.get("segment"), batch.get("attention_mask"), 2 * pairs,
                                 whole=self.nll == "whole")[:pairs]
        return {"pairs": per_row(torch.ones_like(tokens), batch), "nll_tokens": per_row(tokens, batch)}

    def begin_step(self, totals: dict[str, torch.Tensor]) -> None:
        self._step_scale = totals["pairs"] / totals["nll_tokens"].clamp(min=1)

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Each pair's loss; a pair is one item of the step's mean. TRL's metrics per pair too: the engine
        logs their means over the logging window's pairs (``train/rewards/accuracies``...), as evaluation does.
        Packed, a row is the engine's sample: its pairs' sums, and their count as its items."""
        losses, metrics = self._pairs(model, batch)
        if "pair_row" in batch:
            pairs = per_row(torch.ones_like(losses, dtype=torch.int64), batch)
            return StepOutput(sample_losses=per_row(losses, batch), sample_items=pairs,
                              sample_metrics={name: per_row(values, batch) for name, values in metrics.items()})
        return StepOutput(sample_losses=losses, sample_items=1, sample_metrics=metrics)

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        losses, metrics = self._pairs(model, batch)
        sums = {"loss": losses.detach(), **metrics, "pairs": torch.ones_like(losses)}
        return {name: per_row(values, batch) for name, values in sums.items()}

    def metrics_from_sums(self, sums: dict[str, float]) -> dict[str, float]:
        pairs = max(sums["pairs"], 1.0)
        return {name: sums[name] / pairs for name in self.metric_names}

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Not called (the engine reduces :meth:`evaluation_sums`); from gathered rows of the same
        quantities, in ``metric_names`` order then the pair count, it gives the same metrics."""
        totals = logits.double().sum(dim=0).tolist()
        return self.metrics_from_sums(dict(zip((*self.metric_names, "pairs"), totals, strict=False)))

    def _trained_on(self) -> str:
        cfg = self.cfg
        objective = " + ".join(kind.value if weight == 1 else f"{weight:g} × {kind.value}"
                               for kind, weight in zip(self.objectives, self.weights, strict=True))
        options = [f"label smoothing {cfg.label_smoothing}" if cfg.label_smoothing else "",
                   "WPO weighting" if cfg.use_weighting else "",
                   f"LD-DPO α = {cfg.ld_alpha}" if cfg.ld_alpha is not None else ""]
        return f"{objective} preference loss, β = {cfg.beta}" + "".join(f", {o}" for o in options if o)


def sequence_counts(labels: torch.Tensor, segment: torch.Tensor | None, mask: torch.Tensor | None, count: int,
                    whole: bool = False) -> torch.Tensor:
    """Per sequence (rows, or a packed batch's ``count`` segments): its answer tokens, or (``whole``) every
    token after its first (``mask``: an unpacked batch's real tokens), as
    :func:`app.tasks.dpo.logps.sequence_logps` counts them."""
    if segment is None:
        if not whole:
            return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
        real = mask.bool() if mask is not None else torch.ones_like(labels, dtype=torch.bool)
        return real[:, 1:].sum(dim=1)
    if whole:
        counted = (segment[:, 1:] == segment[:, :-1]) & (segment[:, 1:] < count)
    else:
        counted = labels[:, 1:] != IGNORE_INDEX
    owner = torch.where(counted, segment[:, 1:], count).flatten()
    return torch.zeros(count + 1, dtype=torch.int64, device=labels.device).index_add_(
        0, owner, torch.ones_like(owner))[:count]
