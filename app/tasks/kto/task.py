"""``KTOTask``: KTO on answers marked desirable or undesirable, with task=dpo's reference options (a frozen
copy, the LoRA model with its adapters off, values precomputed once (the KL sequences' too), another
model's folder, TR-DPO's synchronisation) and data pipeline (``dpo/preference.py``).

An item is an answer and its mismatched KL sequence (``answers.py``); a batch holds the answers' rows,
then the KL rows. The KL estimate z is the mean over the optimizer step's KL sequences (every
micro-batch, every process) of the policy's minus the reference's summed answer log-probabilities,
clamped at 0 and detached: the engine totals it before the step's first micro-batch is trained
(``app.tasks.base.ReadsStepTotals``: :meth:`step_sums` runs the KL rows, :meth:`begin_step` takes the
totals), and each micro-batch's ``step`` runs only its answers' rows. So an answer's loss, and the update,
are the same at any batch split (TRL's z is the batch's own, gathered across processes: it changes with
the batch size). An answer is one item of the engine's loss (``sample_items=1``).

Evaluation (``SummedMetrics``) takes z over each evaluation batch (on every process together), as TRL
does; its metrics are TRL's: ``eval/loss``, ``eval/kl``, ``eval/rewards/chosen`` and ``logps/chosen``
over the desirable answers, ``rewards/rejected`` and ``logps/rejected`` over the undesirable ones,
``rewards/margins`` between the two; training logs the same over each logging window
(``DerivesTrainingMetrics``)."""

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
from app.tasks.dpo.logps import sequence_logps
from app.tasks.dpo.preference import PreferenceTask
from app.tasks.dpo.reference import Precomputed
from app.tasks.dpo.stream import PairStream
from app.tasks.kto.answers import (
    SIDES,
    AnswerFields,
    answer_features,
    bad_answers,
    encode_answers,
    stream_answers,
    with_kl,
)
from app.tasks.kto.config import KTOConfig
from app.tasks.kto.loss import METRICS, OBJECTIVES, USES_KL, Answers, answer_metrics, metrics_from_sums
from app.tasks.sft.bad_rows import Skipped
from app.tasks.sft.records import Places

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

ROWS = ("input_ids", "labels", "attention_mask")


def half(batch: dict[str, torch.Tensor], which: int) -> dict[str, torch.Tensor]:
    """The batch's answer rows (``which`` 0) or its KL rows (1), with the items' numbers."""
    items = len(batch["pair"])
    rows = slice(which * items, (which + 1) * items)
    return {**{key: batch[key][rows] for key in ROWS if key in batch}, "pair": batch["pair"]}


class KTOTask(PreferenceTask):
    unit = "answers"
    sides = SIDES  # type: ignore[assignment]
    per_item = ("label",)
    metric_names = ("loss", *METRICS)  # type: ignore[assignment]
    data_kind = "answers marked good or bad"

    def __init__(self, cfg: KTOConfig):
        super().__init__(cfg)
        self.cfg: KTOConfig = cfg
        self.objective = OBJECTIVES[cfg.loss_type]
        self._step_z: torch.Tensor | None = None
        """The optimizer step's KL estimate (``begin_step``); None: the batch's own."""
        self._counts: tuple[int, int] | None = None
        """The training split's desirable and undesirable answers (map-style)."""

    # -- data: task=kto's rows (the pipeline is PreferenceTask's) ----------------------------------------------

    def _fields(self, places: Places) -> AnswerFields:
        return AnswerFields.of(self.cfg, places)

    def _encoder(self, fields: Any) -> Callable[..., dict[str, list]]:
        return functools.partial(encode_answers, tokenizer=self.tokenizer, fields=fields)

    def _features(self) -> datasets.Features:
        return answer_features()

    def _bad_streamed(self, fields: Any) -> Callable[[list[str], list[int]], list[Skipped]]:
        return functools.partial(bad_answers, tokenizer=self.tokenizer, fields=fields)

    def _stream(self, path: Path, begin: int, fields: Any) -> PairStream:
        rows_of = functools.partial(stream_answers, tokenizer=self.tokenizer, fields=fields, seed=self.cfg.split_seed)
        return PairStream(path, begin, rows_of, self.cfg.block_size)

    def _check_columns(self, columns: list[str], origin: str) -> None:
        cfg = self.cfg
        unpaired, paired = (cfg.completion_field, cfg.label_field), (cfg.chosen_field, cfg.rejected_field)
        if not (set(unpaired) <= set(columns) or set(paired) <= set(columns)):
            raise ConfigError(f"{origin} has neither {' and '.join(map(repr, unpaired))} columns nor "
                              f"{' and '.join(map(repr, paired))} ones (it has {', '.join(columns)}); task=kto reads "
                              "prompt/completion/label rows or preference pairs: set task.completion_field and "
                              "task.label_field, or task.chosen_field and task.rejected_field.")

    def _conversational(self, record: dict[str, Any]) -> bool:
        cfg = self.cfg
        return any(isinstance(record.get(c), list) for c in (cfg.prompt_field, cfg.completion_field, cfg.chosen_field))

    def _completed(self, items: datasets.Dataset, name: str) -> datasets.Dataset:
        if name == "train":
            good = sum(items["label"])
            self._counts = (good, len(items) - good)
        return with_kl(items, self.cfg.block_size, self.cfg.split_seed)

    def _said_at_start(self) -> None:
        """The answers of each kind and, where they are out of balance, the weights that balance them (the
        KTO paper's rule: λ_D·n_D / (λ_U·n_U) in [1, 4/3])."""
        if self._counts is None:
            return
        good, bad = self._counts
        self._splits_read.append(f"training answers: {good:,} desirable, {bad:,} undesirable")
        cfg = self.cfg
        ratio = cfg.desirable_weight * max(good, 1) / (cfg.undesirable_weight * max(bad, 1))
        if good and bad and not 1.0 <= ratio <= 4 / 3:
            lower = cfg.undesirable_weight * bad / good
            upper = cfg.desirable_weight * good / bad
            log.warning("task=kto: %d desirable and %d undesirable answers weighted %g and %g (λ_D·n_D / λ_U·n_U = "
                        "%.2f); the KTO paper keeps it in [1, 4/3]: task.desirable_weight in [%.2f, %.2f] or "
                        "task.undesirable_weight in [%.2f, %.2f] (one of the two)", good, bad, cfg.desirable_weight,
                        cfg.undesirable_weight, ratio, lower, 4 / 3 * lower, upper * 3 / 4, upper)

    # -- steps ---------------------------------------------------------------------------------------------

    def _logps(self, model: nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each row's summed answer log-probability."""
        return sequence_logps(self._logits(model, rows), rows["labels"]).logps

    def _reference(self, model: nn.Module, batch: dict[str, torch.Tensor], which: int) -> torch.Tensor:
        """The reference's log-probabilities of the answer rows (0) or the KL rows (1)."""
        assert self.reference is not None  # build_data / build_model chose it
        if isinstance(self.reference, Precomputed):  # a table row per item: answer, then KL sequence
            return self.reference(model, batch, self._logps).view(2, -1)[which]
        return self.reference(model, half(batch, which), self._logps)

    @property
    def reads_step_totals(self) -> bool:
        return self.cfg.loss_type in USES_KL

    def step_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per item, its KL sequence's ``log π - log ref`` (z's numerator), and 1 (its denominator)."""
        kl = self._logps(model, half(batch, 1)) - self._reference(model, batch, 1).to(torch.float32)
        return {"kl": kl, "answers": torch.ones_like(kl)}

    def begin_step(self, totals: dict[str, torch.Tensor]) -> None:
        self._step_z = (totals["kl"] / totals["answers"].clamp(min=1)).clamp(min=0).detach()

    def _batch_z(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """z over this batch on every process together (evaluation, or a step without totals)."""
        with torch.no_grad():
            sums = torch.stack([value.sum() for value in self.step_sums(model, batch).values()]).float()
        runtime = self._runtime
        if runtime is not None and runtime.num_processes > 1:
            sums = runtime.reduce(sums, "sum")
        return (sums[0] / sums[1].clamp(min=1)).clamp(min=0)

    def _answers(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per answer: the loss and what TRL's metrics sum."""
        logps = self._logps(model, half(batch, 0))
        ratios = logps - self._reference(model, batch, 0).to(logps.dtype)
        if self.cfg.loss_type not in USES_KL:
            z = torch.zeros((), device=logps.device)
        elif model.training and self._step_z is not None:
            z = self._step_z
        else:
            z = self._batch_z(model, batch)
        cfg = self.cfg
        answers = Answers(ratios, batch["label"].bool(), z, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight)
        return self.objective(answers), answer_metrics(answers, logps)

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        losses, metrics = self._answers(model, batch)
        return StepOutput(sample_losses=losses, sample_items=1, sample_metrics=metrics)

    def training_metrics(self, sums: dict[str, float], items: float) -> dict[str, float]:
        return metrics_from_sums(sums, items)

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        losses, metrics = self._answers(model, batch)
        return {"loss": losses.detach(), **metrics, "answers": torch.ones_like(losses)}

    def metrics_from_sums(self, sums: dict[str, float]) -> dict[str, float]:
        answers = max(sums["answers"], 1.0)
        found = {"loss": sums["loss"] / answers, **metrics_from_sums(sums, answers)}
        return {name: found.get(name, 0.0) for name in self.metric_names}

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Not called (the engine reduces :meth:`evaluation_sums`)."""
        raise NotImplementedError("task=kto's evaluation metrics come from evaluation_sums")

    def _trained_on(self) -> str:
        cfg = self.cfg
        return (f"{cfg.loss_type.value} loss, β = {cfg.beta}, desirable weight {cfg.desirable_weight}, "
                f"undesirable weight {cfg.undesirable_weight}")
