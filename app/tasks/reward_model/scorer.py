"""A saved reward model, frozen, scoring (prompt, completion) pairs in batches: what ``task=grpo``'s
``task.rewards`` entry ``{reward_model: <folder>}`` calls. The folder is this task's export or any one-label
``AutoModelForSequenceClassification`` with its tokenizer.

Each pair is formatted as ``task=reward_model`` formats a side of a training pair, through the same
functions (``app/tasks/sft``): a conversation (a prompt of messages; the completion its assistant turn, or
turns) rendered by the reward model's chat template; strings as plain text, the tokenizer's BOS first and
EOS last. (A string prompt with a conversation as the completion is its user turn; a model without a chat
template reads a conversation's turns as plain text, one a line.) Rows are padded on the right and scored
by the model's own forward (``logits[:, 0]``): for this task's export, the score at the last real token,
as trained (its padding token ends no sequence: ``model.py``).

    >>> scorer = RewardScorer("outputs/<date>/<time>/model")
    >>> scorer.score(["2 + 2 = ?"], ["4"])                       # [1.73]: higher is better
    >>> scorer(prompts=[[{"role": "user", "content": "hi"}]],   # TRL's reward-function call
    ...        completions=[[{"role": "assistant", "content": "hello"}]])

Under FSDP2 the model is placed as a reference copy is (:meth:`RewardScorer.place` with the runtime's
``prepare_model(..., evaluation_mode=True)``), and then every process must score the same number of
batches: give each the same number of pairs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.sft.config import TrainOn
from app.tasks.sft.conversations import BadRow, content_text, messages
from app.tasks.sft.spans import Formatted, SpanFinder
from app.tasks.sft.tokens import tokenize

log = logging.getLogger(__name__)


class RewardScorer:
    """``folder``'s tokenizer and one-label classifier, in evaluation mode with its parameters frozen; scores in
    batches of ``batch_size`` pairs, in float32 (``dtype``: the weights' type)."""

    def __init__(self, folder: str | Path, batch_size: int = 16, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.folder, self.batch_size = str(folder), batch_size
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
            model = AutoModelForSequenceClassification.from_pretrained(self.folder, dtype=dtype)
        except (OSError, ValueError) as err:
            raise ConfigError(f"reward_model={self.folder} cannot be loaded as a sequence classifier with its "
                              f"tokenizer: {str(err).strip().splitlines()[0]}") from None
        if model.config.num_labels != 1:
            raise ConfigError(f"reward_model={self.folder} has {model.config.num_labels} labels; a reward model "
                              "scores with one (its logit is the reward): give a one-label sequence classifier.")
        self.pad = self._padding(model)
        self.model: nn.Module = model.eval().requires_grad_(False)
        self.finder = SpanFinder(self.tokenizer, TrainOn.assistant)
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))

    def _padding(self, model: Any) -> int:
        """The id rows are padded with: the model's own (what its pooling skips), else the tokenizer's padding
        or EOS token, which the model is then given (as TRL gives it)."""
        own = model.config.pad_token_id
        if isinstance(own, int):
            return own
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        if pad is None:
            raise ConfigError(f"reward_model={self.folder} names no padding token, and its tokenizer has neither a "
                              "padding nor an EOS token to pad its batches with.")
        model.config.pad_token_id = pad
        log.info("reward_model=%s names no padding token: its rows are padded with %s (id %d)", self.folder,
                 self.tokenizer.convert_ids_to_tokens(pad), pad)
        return int(pad)

    def place(self, prepare: Callable[[nn.Module], nn.Module]) -> None:
        """Put the model where the run's models are (``prepare``: e.g. the runtime's
        ``prepare_model(model, evaluation_mode=True)``: on its device, sharded under FSDP2)."""
        self.model = prepare(self.model)

    def to(self, device: torch.device | str) -> RewardScorer:
        self.model.to(device)
        return self

    # -- formatting ----------------------------------------------------------------------------------------

    def formatted(self, prompt: Any, completion: Any) -> Formatted:
        """A (prompt, completion) pair as the reward model reads it (see the module)."""
        if isinstance(prompt, str) and isinstance(completion, str):
            return Formatted(prompt + completion, [], plain=True)
        try:  # the messages read as training reads them (roles, ShareGPT's keys, text parts, tool calls)
            turns = messages([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt, "prompt")
            answer = messages([{"role": "assistant", "content": completion}] if isinstance(completion, str)
                              else completion, "completion")
            if not self.templated:
                lines = [content_text(m.get("content") or "", "a message") for m in [*turns, *answer]]
                return Formatted("\n".join(lines[:len(turns)]) + "\n" + "\n".join(lines[len(turns):]), [], plain=True)
            return Formatted(self.finder.render([*turns, *answer]), [], plain=False)
        except BadRow as err:
            raise ConfigError(f"reward_model={self.folder} cannot read a prompt and its completion: {err}.") from None

    def token_rows(self, prompts: list[Any], completions: list[Any]) -> list[list[int]]:
        """Each pair's tokens, as :meth:`score` scores them."""
        pairs = [self.formatted(p, c) for p, c in zip(prompts, completions, strict=True)]
        return [ids for ids, _ in tokenize(self.tokenizer, pairs)]

    # -- scoring -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, prompts: list[Any], completions: list[Any]) -> list[float]:
        """Each pair's score, in order (``batch_size`` pairs per forward pass)."""
        rows = self.token_rows(prompts, completions)
        self._check_lengths(rows)
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start:start + self.batch_size]
            length = max(len(r) for r in batch)
            ids = torch.full((len(batch), length), self.pad, dtype=torch.int64)
            mask = torch.zeros((len(batch), length), dtype=torch.int64)
            for i, row in enumerate(batch):
                ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
            logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores

    def _check_lengths(self, rows: list[list[int]]) -> None:
        """A row longer than the model's positions is refused in one sentence, not cut: a cut would drop
        either the completion's end (where a causal LM's score is read) or the prompt's start (a BERT-like
        model's first token)."""
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        longest = max((len(row) for row in rows), default=0)
        if isinstance(limit, int) and longest > limit:
            raise ConfigError(f"reward_model={self.folder} reads at most {limit} tokens, and a prompt with its "
                              f"completion makes {longest}: give shorter prompts or task.max_completion_length, or a "
                              "reward model with more positions.")

    def __call__(self, prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        """The scores as a TRL reward function returns them (other columns are not read)."""
        return self.score(prompts, completions)
