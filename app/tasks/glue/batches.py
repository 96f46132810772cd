"""From tokenized rows to batches: padding, and a row's optional second view.

A row may carry a second encoding of the same example beside its own, in ``swapped_*`` columns
(MRPC's ``symmetric_eval``: the pair in the other order). The collator pads each view on its own,
and ``GlueTask.predict`` scores both and averages them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

SWAPPED = "swapped_"
"""Prefix of the columns holding a row's pair in the other order (``symmetric_eval``)."""


def with_swapped_pairs(plain: datasets.Dataset, swapped: datasets.Dataset) -> datasets.Dataset:
    """``plain``'s rows with the same pairs' swapped encoding as ``swapped_*`` columns beside them."""
    import datasets

    extra = swapped.remove_columns("labels")
    extra = extra.rename_columns({name: SWAPPED + name for name in extra.column_names})
    return datasets.concatenate_datasets([plain, extra], axis=1)


def split_swapped(row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A row or batch's own pair, and its swapped pair with the ``swapped_`` prefix removed."""
    plain = {k: v for k, v in row.items() if not k.startswith(SWAPPED)}
    swapped = {k.removeprefix(SWAPPED): v for k, v in row.items() if k.startswith(SWAPPED)}
    return plain, swapped


class PaddingCollator:
    """Pads rows to the longest in the batch (rows padded at tokenization stay max_length long), or
    to ``fixed_length`` when given (fixed shapes for XLA); swapped pairs, when the rows carry them,
    are padded on their own.

    Returns a plain dict of tensors: BatchEncoding is not a dict subclass, and the engine moves
    batches to devices by walking dicts.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, fixed_length: int | None = None):
        from transformers import DataCollatorWithPadding

        if fixed_length is None:
            self._pad = DataCollatorWithPadding(tokenizer, padding="longest", return_tensors="pt")
        else:
            self._pad = DataCollatorWithPadding(tokenizer, padding="max_length", max_length=fixed_length,
                                                return_tensors="pt")

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if SWAPPED + "input_ids" not in rows[0]:
            return dict(self._pad(rows))
        plain, swapped = zip(*(split_swapped(row) for row in rows))
        batch = dict(self._pad(list(plain)))
        batch.update({SWAPPED + k: v for k, v in self._pad(list(swapped)).items()})
        return batch
