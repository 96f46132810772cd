"""``task.predict_test=true``: every evaluation pair's two scores, after training and with ``mode=eval``,
written to ``<run>/test_predictions.tsv`` (the engine's ``app/engine/predict.py`` gathers them in order
across processes), so a user can read where the model disagrees with the data.

One line per pair, in the evaluation set's order: ``pair`` (1, 2, … in that order), ``chosen_score``,
``rejected_score``, ``difference`` (chosen − rejected), ``chosen_ahead`` (1 or 0: the accuracy's count),
then the pair's ``prompt``, ``chosen`` and ``rejected`` answers as the model read them (decoded, special
tokens kept), tab-separated, a text with a tab, a newline or a quote quoted as CSV quotes it
(``pandas.read_csv(path, sep="\\t")`` reads it back).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.dpo.pairs import SIDES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HEADER = ("pair", "chosen_score", "rejected_score", "difference", "chosen_ahead", "prompt", "chosen", "rejected")


class OnePairRows(Dataset):
    """Pairs as packed rows of one pair each, for a packed run's collate function (scores per pair, in order)."""

    def __init__(self, pairs: Any):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> list[dict[str, Any]]:
        return [self.pairs[index]]


def texts(pair: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> tuple[str, str, str]:
    """A pair's prompt (the chosen side's tokens before its answer) and its two answers (the learnt tokens)."""
    labels = pair["chosen_labels"]
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    prompt = str(tokenizer.decode(pair["chosen_ids"][:first]))
    answers = [str(tokenizer.decode([t for t in pair[f"{side}_labels"] if t != IGNORE_INDEX])) for side in SIDES]
    return prompt, answers[0], answers[1]


def write_scores(pairs: Any, scores: torch.Tensor, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> None:
    """``scores``: ``(pairs, 2)``, chosen then rejected, in ``pairs``' order."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(HEADER)
        for k, (chosen, rejected) in enumerate(scores.tolist()):
            writer.writerow([k + 1, f"{chosen:.6g}", f"{rejected:.6g}", f"{chosen - rejected:.6g}",
                             int(chosen > rejected), *texts(pairs[k], tokenizer)])
