"""A pair's two token rows within ``task.block_size``: the prompt cut to ``task.max_prompt_length``
(``task.truncation_mode``, ``app/tasks/sft/truncation.py``); then a side still longer than the block,
by ``task.overlong``: ``truncate`` cuts the pair's prompt to half the block (when no
``max_prompt_length`` is given) and its answers at the block's end, ``drop`` leaves the pair out,
``refuse`` refuses it. Both sides are cut alike, so they keep the same prompt: a prompt longer than the
block no longer leaves the answer no room.

TRL 1.16 has ``max_length`` with ``truncation_mode=keep_start`` over the whole sequence instead, which
cuts from the answer's end and can cut the answer away when the prompt is long; here the answer is cut
only once the prompt is as short as it may be."""

from __future__ import annotations

from dataclasses import dataclass

from app.tasks.dpo.config import PreferenceConfig
from app.tasks.sft.config import Overlong, TruncationMode
from app.tasks.sft.conversations import BadRow
from app.tasks.sft.truncation import cut_prompt

Side = tuple[list[int], list[int]]
"""A side's token ids and labels (-100: not learnt)."""


@dataclass(frozen=True)
class PairFit:
    """How a run fits its pairs into the block (picklable for ``datasets.map``)."""

    block_size: int
    overlong: Overlong = Overlong.truncate
    max_prompt_length: int | None = None
    truncation_mode: TruncationMode = TruncationMode.keep_end

    @classmethod
    def of(cls, cfg: PreferenceConfig) -> PairFit:
        return cls(cfg.block_size, cfg.overlong, cfg.max_prompt_length, cfg.truncation_mode)


@dataclass
class Fitted:
    """The pair's sides as trained on (none when it is dropped) and what was done to it, each counted
    once per pair in the log."""

    sides: list[Side]
    prompt_cut: bool = False
    answer_cut: bool = False
    dropped: bool = False


def fit_pair(sides: list[Side], fit: PairFit, bos: int | None, names: tuple[str, ...] = ("chosen", "rejected")
             ) -> Fitted:
    """The sides (the chosen and rejected ones; ``names`` says which they are) fitted into
    ``fit.block_size``; BadRow with ``task.overlong=refuse`` for a side longer than it. ``bos``: the
    tokenizer's BOS, kept first in a cut prompt."""
    cut = sides
    if fit.max_prompt_length is not None:
        cut = [cut_prompt(ids, labels, fit.max_prompt_length, fit.truncation_mode, bos) for ids, labels in cut]
    long = [(name, len(ids)) for name, (ids, _) in zip(names, cut, strict=True) if len(ids) > fit.block_size]
    prompt_cut = cut != sides
    if not long:
        return Fitted(cut, prompt_cut=prompt_cut)
    if fit.overlong is Overlong.refuse:
        name, length = long[0]
        raise BadRow(f"its {name} side is {length} tokens long, more than task.block_size={fit.block_size} "
                     "(task.overlong=refuse); give a larger block_size, or task.overlong=truncate or drop")
    if fit.overlong is Overlong.drop:
        return Fitted([], dropped=True)
    if fit.max_prompt_length is None:  # the prompt first, to half the block, so the answer keeps room
        halved = [cut_prompt(ids, labels, fit.block_size // 2, fit.truncation_mode, bos) for ids, labels in cut]
        prompt_cut, cut = prompt_cut or halved != cut, halved
    answer_cut = any(len(ids) > fit.block_size for ids, _ in cut)
    return Fitted([(ids[:fit.block_size], labels[:fit.block_size]) for ids, labels in cut], prompt_cut, answer_cut)
