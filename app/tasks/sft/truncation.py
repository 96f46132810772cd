"""A long prompt cut to a number of tokens (``task.max_prompt_length``), from the end or the start
(``task.truncation_mode``). The prompt is a formatted row's tokens before its first learnt one; what
follows it (the answer, and for a conversation the turns after) is kept whole. Pure lists in, lists
out: ``task=dpo`` cuts both sides of a pair with it, prompt/completion ``task=sft`` may too."""

from __future__ import annotations

from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.sft.config import TruncationMode


def prompt_length(labels: list[int]) -> int:
    """The tokens before the first learnt one (all of them when nothing is learnt)."""
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def cut_prompt(ids: list[int], labels: list[int], max_length: int, mode: TruncationMode,
               bos: int | None = None) -> tuple[list[int], list[int]]:
    """``ids`` and ``labels`` with the prompt cut to ``max_length`` tokens (unchanged if it is not longer,
    or if nothing is learnt: no prompt to tell apart). A leading ``bos`` stays first, one of the
    ``max_length``: the model was trained with it there."""
    if max_length < 1:
        raise ValueError(f"a prompt is cut to 1 token or more, not {max_length}")
    prompt = prompt_length(labels)
    if prompt <= max_length or prompt == len(labels):
        return ids, labels
    head = 1 if bos is not None and ids and ids[0] == bos else 0
    room = max_length - head
    kept = range(prompt - room, prompt) if mode is TruncationMode.keep_end else range(head, head + room)
    keep = [*range(head), *kept, *range(prompt, len(ids))]
    return [ids[i] for i in keep], [labels[i] for i in keep]
