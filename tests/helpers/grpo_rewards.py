"""Reward functions for ``task=grpo``'s tests (named by ``_target_: tests.helpers.grpo_rewards.<name>``): TRL's
signature ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``."""

from __future__ import annotations

import os
from typing import Any

WORD = "the"


def text(completion: Any) -> str:
    """A completion's text (a conversational prompt's completion is ``[{"role": "assistant", "content": ...}]``)."""
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def word_share(completions: list[Any], word: str = WORD, **_: Any) -> list[float]:
    """The share of a completion's words that are ``word`` (0 for an empty one)."""
    shares = []
    for completion in completions:
        words = text(completion).split()
        shares.append(sum(w == word for w in words) / len(words) if words else 0.0)
    return shares


def even_tokens(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The share of a completion's token ids that are even: different for almost every completion of an
    untrained model (advantages that are not all 0)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def short(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """1 for a completion of at most 4 tokens, else 0."""
    return [float(len(ids) <= 4) for ids in completion_ids]


def answer_given(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
    """1 where the row's ``answer`` column is in the completion, 0 where not; None for a row without one."""
    return [None if a is None else float(str(a) in text(c)) for c, a in zip(completions, answer, strict=True)]


class Offset:
    """A class entry: instantiated once with its keyword arguments (``offset``), then called."""

    instances = 0

    def __init__(self, offset: float):
        Offset.instances += 1
        self.offset, self.made = offset, Offset.instances

    def __call__(self, completions: list[Any], **_: Any) -> list[float]:
        return [self.offset + self.made - 1 for _ in completions]


def one_value(completions: list[Any], **_: Any) -> list[float]:
    return [1.0]


def words(completions: list[Any], **_: Any) -> list[Any]:
    return ["good" for _ in completions]


def no_opinion(completions: list[Any], **_: Any) -> list[None]:
    return [None for _ in completions]


_CALLS = {"n": 0}


def fails_on_third_call(completions: list[Any], **_: Any) -> list[float]:
    """Raises at its third call (``GRPO_TEST_FAIL_AT`` calls: the third generation batch by default)."""
    _CALLS["n"] += 1
    if _CALLS["n"] >= int(os.environ.get("GRPO_TEST_FAIL_AT", "3")):
        raise ValueError("the grader is down\nsecond line")
    return word_share(completions)
