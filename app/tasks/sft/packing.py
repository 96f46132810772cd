"""Whole conversations packed into rows of ``task.block_size`` tokens, and rows into batches.

Packing is best-fit decreasing (longest conversation first, each into the fullest row it still fits),
so rows are nearly full and no conversation is ever split. Each row carries ``position_ids`` that
restart at 0 with every conversation, and no 2-D attention mask: from those positions the model's
attention is block-diagonal (Transformers' packed-sequence detection for SDPA, eager and flex
attention; FlashAttention's varlen path), so a conversation never attends to the one packed before it.
``attention.py`` checks this on the built model, and gives the explicit 4-D mask used where shapes are
fixed (XLA). The tail of a row is padding: its own sequence (positions from 0), labels -100.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from app.tasks.causal_lm.batches import IGNORE_INDEX

if TYPE_CHECKING:
    import datasets


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity`` (each length fits one), few bins:
    longest first, each into the bin with the least room that still holds it. Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, bin), sorted
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(room, (n, -1))
        if at == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - n, len(bins) - 1))
        else:
            free, b = room.pop(at)
            bins[b].append(i)
            bisect.insort(room, (free - n, b))
    return bins


class PackedRows(Dataset):
    """Rows of whole conversations (``bins`` of indices into ``rows``), concatenated on access, each
    with its ``position_ids`` restarting at 0 per conversation."""

    def __init__(self, rows: datasets.Dataset, block_size: int):
        self.rows = rows.select_columns(["input_ids", "labels"])
        self.bins = best_fit_decreasing([len(ids) for ids in rows["input_ids"]], block_size)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        members = self.rows[self.bins[index]]
        return packed_row(members["input_ids"], members["labels"])

    def conversations(self) -> int:
        return sum(len(b) for b in self.bins)

    def samples_packed(self) -> int:
        """``app.tasks.base.PacksSamples``: the conversations, which ``eval/num_samples`` counts."""
        return self.conversations()


def packed_row(input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]) -> dict[str, list[int]]:
    """Conversations concatenated into one row, ``position_ids`` restarting at 0 with each.

    A conversation's first token is predicted by nothing of its own: alone in a row it is never a
    target; packed, it would be the previous conversation's last target. Its label goes."""
    return {"input_ids": [t for ids in input_ids for t in ids],
            "labels": [t for row in labels for t in [IGNORE_INDEX, *row[1:]]],
            "position_ids": [p for ids in input_ids for p in range(len(ids))]}


class SFTCollator:
    """Rows into a batch: ``input_ids`` and ``labels`` (-100: not learnt), padded on the right to the
    longest row, to ``fixed_length`` (packed rows: the block; XLA: always). Packed rows get
    ``position_ids`` (the padding is a sequence of its own) and no attention mask; single
    conversations of different lengths get an ``attention_mask`` that hides the padding."""

    def __init__(self, pad_id: int, fixed_length: int | None = None):
        self.pad_id, self.fixed_length = pad_id, fixed_length

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(row["input_ids"]) for row in rows]
        length = self.fixed_length or max(lengths)
        packed = "position_ids" in rows[0]
        ids = np.full((len(rows), length), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
        positions = np.tile(np.arange(length, dtype=np.int64), (len(rows), 1))
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            ids[i, :n], labels[i, :n] = row["input_ids"], row["labels"]
            if packed:
                positions[i, :n] = row["position_ids"]
                positions[i, n:] -= n
        batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if packed:
            batch["position_ids"] = torch.from_numpy(positions)
        elif any(n != length for n in lengths):
            batch["attention_mask"] = torch.from_numpy((np.arange(length) < np.asarray(lengths)[:, None])
                                                       .astype(np.int64))
        return batch
