"""``task.rewards`` made callable, and called: each entry's function (or class, instantiated once) imported as a
``_target_`` task is (the working directory, ``PYTHONPATH``, an installed package), its extra keys bound as
keyword arguments; or a reward model (``{reward_model: <folder>}``: a ``task=reward_model`` export or any
one-label sequence classifier, scored by ``app/tasks/reward_model/scorer.py``'s ``RewardScorer``, which formats
prompt + completion as ``task=reward_model`` trains on them).

A function is called as TRL calls it, once per generation batch on each process, for that process's
completions: ``f(prompts=..., completions=..., completion_ids=..., **columns)`` — a prompt (as the data has
it, repeated for each of its completions), the completion (its text; for a conversational prompt
``[{"role": "assistant", "content": text}]``), its token ids (the stop token included) and every other
column of the row by name. What it returns is checked (``advantages.reward_column``: one number or None per
completion, never a single value spread over all); whatever goes wrong comes back as one sentence naming the
entry, its function and the step (:class:`Scores`), which the task raises on every process alike.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from app.config import ConfigError
from app.tasks.external import import_target
from app.tasks.grpo.advantages import RewardError, reward_column
from app.tasks.grpo.config import RewardSpec
from app.tasks.reward_model.scorer import RewardScorer

PROMPT_SHOWN = 80
"""Characters of the first prompt a refusal quotes."""


@dataclass
class Reward:
    """One ``task.rewards`` entry, ready to call: ``label`` names it in sentences (``task.rewards[1] (format)``)."""

    spec: RewardSpec
    label: str
    function: Callable[..., Any]


def load_rewards(specs: Sequence[RewardSpec]) -> list[Reward]:
    """Each entry imported (a class instantiated once with its keyword arguments; a function bound to them)
    or its reward model loaded; one sentence for an entry that cannot be."""
    rewards = []
    for i, spec in enumerate(specs):
        label = f"task.rewards[{i}] ({spec.name})"
        if spec.reward_model is not None:
            rewards.append(Reward(spec, label, RewardScorer(spec.reward_model)))
            continue
        assert spec.target is not None  # read_reward: one of the two
        target = import_target(spec.target, f"task.rewards[{i}]._target_")
        if inspect.isclass(target):
            try:
                target = target(**spec.kwargs)
            except Exception as err:  # noqa: BLE001 - the user's constructor: said in one sentence
                raise ConfigError(f"{label}: {spec.target}({_arguments(spec.kwargs)}) raised {type(err).__name__}: "
                                  f"{_first_line(err)}") from None
        elif spec.kwargs:
            target = functools.partial(target, **spec.kwargs)
        if not callable(target):
            raise ConfigError(f"{label}: {spec.target} is not a function or a class of callable objects.")
        rewards.append(Reward(spec, label, target))
    return rewards


def place_reward_models(rewards: Sequence[Reward], device: torch.device) -> None:
    for reward in rewards:
        if isinstance(reward.function, RewardScorer):
            reward.function.to(device)


@dataclass
class Scores:
    """One process's scoring of its completions: a column per reward (NaN: no opinion), or the sentence
    that refuses it."""

    columns: list[list[float]] | None
    error: str | None = None


def score(rewards: Sequence[Reward], prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
          columns: dict[str, list[Any]], when: str) -> Scores:
    """Every reward on these completions (``when``: ``at step 12``, ``at the evaluation of step 12``)."""
    out = []
    for reward in rewards:
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                     **columns)
        except Exception as err:  # noqa: BLE001 - the user's function: its error is said, not a traceback
            shown = str(prompts[0]) if prompts else ""
            shown = shown if len(shown) <= PROMPT_SHOWN else shown[:PROMPT_SHOWN - 1] + "…"
            return Scores(None, f"{reward.label} raised {type(err).__name__} {when}: {_first_line(err)}; first "
                                f"prompt: {shown!r}.")
        try:
            out.append(reward_column(f"{reward.label} {when}", values, len(completions)))
        except RewardError as err:
            return Scores(None, str(err))
    return Scores(out)


def unscored_sentence(table: torch.Tensor, when: str) -> str | None:
    """The refusal of a generation batch where no completion has a reward (every function said None)."""
    if table.numel() and bool(table.isnan().all()):
        return (f"every reward returned None for all {table.shape[0]} completions {when}: nothing to learn from "
                "(a reward returns None for a completion it has no opinion on, a number otherwise).")
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0].rstrip(".") if text else "(no message)"


def _arguments(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
