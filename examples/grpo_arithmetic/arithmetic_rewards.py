"""The example's two rewards, named in the command by ``_target_: arithmetic_rewards.<name>`` (this folder is the
working directory, so Python finds the module). TRL's signature: the prompts, the completions (for a chat prompt
``[{"role": "assistant", "content": text}]``), their token ids, and every other column of the rows by name."""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"-?\d+")


def text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def exact_answer(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1 where the completion's first number is the row's answer, else 0."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        found = NUMBER.search(text(completion))
        scores.append(float(found is not None and found.group() == expected))
    return scores


def starts_with_a_number(completions: list[Any], **_: Any) -> list[float]:
    """The format: 1 where the completion begins with a number (spaces aside), else 0."""
    return [float(NUMBER.match(text(c).lstrip()) is not None) for c in completions]
