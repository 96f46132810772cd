"""Preference pairs packed into rows (``task.packing=true``): both sides of each pair, whole, in one row.

A row holds whole pairs, each as two sequences (prompt + chosen answer, prompt + rejected answer), its
``position_ids`` restarting at 0 with each sequence, so that no sequence attends to another (the same
attention as ``task=sft``'s packing: ``app/tasks/sft/attention.py``). Pairs go into rows by best-fit
decreasing of their two sides' total length; a row's capacity is twice ``task.block_size``, so that any
pair fits (each side is at most the block). A batch numbers its pairs 0..P-1 and gives every token a
``segment``: ``j`` for pair j's chosen side, ``P + j`` for its rejected side, ``2P`` for padding, so the
summed answer log-probabilities come out in the unpacked batch's order (chosen sides, then rejected
sides), and ``pair_row`` says which row holds each pair (the engine's samples are rows). A pair's other
values (its number ``pair``, a reward model's ``margin``) come as one tensor each, in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.dpo.pairs import SIDES
from app.tasks.sft.packing import best_fit_decreasing, packed_row

if TYPE_CHECKING:
    import datasets


class PackedPairs(Dataset):
    """Rows of whole pairs (``bins`` of indices into ``pairs``); a row is the list of its pairs."""

    def __init__(self, pairs: datasets.Dataset, block_size: int):
        self.pairs = pairs  # its sides' tokens and each pair's other values (per_item_values)
        lengths = [len(c) + len(r) for c, r in zip(pairs["chosen_ids"], pairs["rejected_ids"], strict=True)]
        self.capacity = 2 * block_size
        self.bins = best_fit_decreasing(lengths, self.capacity)

    def samples_packed(self) -> int:
        """``app.tasks.base.PacksSamples``: the pairs, which ``eval/num_samples`` counts."""
        return sum(len(b) for b in self.bins)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> list[dict[str, Any]]:
        members = self.pairs[self.bins[index]]
        return [dict(zip(members, values, strict=True)) for values in zip(*members.values(), strict=True)]


class PackedPairCollator:
    """Rows of pairs into a batch: ``input_ids``, ``labels`` (-100: not learnt), ``position_ids``,
    ``segment``, ``pair_row``, ``pair`` (each pair's number, for the precomputed reference) and its
    ``per_item`` values (a reward model's ``margin``: :func:`per_item_values`); padded on the right to the
    longest row, or to ``fixed_length`` (XLA). No attention mask: see the module."""

    def __init__(self, pad_id: int, fixed_length: int | None = None, per_item: tuple[str, ...] = ()):
        self.pad_id, self.fixed_length, self.per_item = pad_id, fixed_length, ("pair", *per_item)

    def __call__(self, rows: list[list[dict[str, Any]]]) -> dict[str, torch.Tensor]:
        pairs = [p for row in rows for p in row]
        count = len(pairs)
        packed, segments = [], []
        slot = 0
        for row in rows:
            sequences = [(p[f"{side}_ids"], p[f"{side}_labels"], slot + k + (count if side == "rejected" else 0))
                         for k, p in enumerate(row) for side in SIDES]
            slot += len(row)
            packed.append(packed_row([s[0] for s in sequences], [s[1] for s in sequences]))
            segments.append([seg for ids, _, seg in sequences for _ in ids])
        length = self.fixed_length or max(len(joined["input_ids"]) for joined in packed)
        ids = np.full((len(rows), length), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
        positions = np.tile(np.arange(length, dtype=np.int64), (len(rows), 1))
        segment = np.full((len(rows), length), 2 * count, dtype=np.int64)
        for i, (joined, seg) in enumerate(zip(packed, segments, strict=True)):
            n = len(joined["input_ids"])
            ids[i, :n], labels[i, :n], positions[i, :n], segment[i, :n] = (joined["input_ids"], joined["labels"],
                                                                          joined["position_ids"], seg)
            positions[i, n:] -= n  # the padding: a sequence of its own
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions), "segment": torch.from_numpy(segment),
                "pair_row": torch.tensor([i for i, row in enumerate(rows) for _ in row], dtype=torch.int64),
                **per_item_values(pairs, self.per_item)}


def per_item_values(items: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Each of ``names`` over the items, one tensor per name in the items' order: float32 where the values are
    floats (a reward model's ``margin``), else int64 (``pair``, task=kto's ``label``)."""
    out = {}
    for name in names:
        values = [item[name] for item in items]
        out[name] = torch.tensor(values, dtype=torch.float32 if any(isinstance(v, float) for v in values)
                                 else torch.int64)
    return out


def per_row(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-pair values summed per row of a packed batch (the engine's samples); unchanged unpacked."""
    if "pair_row" not in batch:
        return values
    rows = batch["input_ids"].shape[0]
    return torch.zeros(rows, dtype=values.dtype, device=values.device).index_add_(0, batch["pair_row"], values)
