"""Rows of token ids into a causal language model's batch: ``input_ids`` and ``labels`` (the model
shifts them itself), with an ``attention_mask`` and ``-100`` labels on the padding when rows differ
in length (one document per row)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
"""The label the loss skips: padding."""


class LMCollator:
    """Stacks rows of ``input_ids``; rows of different lengths (``packing=false``) are padded on the
    right to the longest in the batch, or to ``fixed_length`` (fixed shapes, for XLA). Packed blocks
    all have the block's length: no padding and no mask (every token is attended to and predicted)."""

    def __init__(self, pad_id: int, fixed_length: int | None = None):
        self.pad_id, self.fixed_length = pad_id, fixed_length

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = [row["input_ids"] for row in rows]
        lengths = [len(ids) for ids in sequences]
        length = self.fixed_length or max(lengths)
        if all(n == length for n in lengths):
            blocks = torch.from_numpy(np.asarray(sequences, dtype=np.int64))
            return {"input_ids": blocks, "labels": blocks.clone()}
        ids = np.full((len(rows), length), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((len(rows), length), dtype=np.int64)
        for i, row in enumerate(sequences):
            ids[i, :len(row)] = row
            labels[i, :len(row)] = row
            mask[i, :len(row)] = 1
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                "labels": torch.from_numpy(labels)}
