"""One row of preference data as two formatted texts, chosen and rejected, and their token rows.

A row is explicit (``prompt``, ``chosen``, ``rejected``: three strings, or three lists of messages) or
has an implicit prompt (``chosen`` and ``rejected`` only, two whole conversations, or two strings, that
begin alike: the prompt is what they share, the messages up to the first that differs). Each side is
formatted as ``task=sft`` formats a prompt/completion pair (``spans.SpanFinder``: the chat template, the
answer's assistant turns learnt with their end-of-turn token; plain strings: BOS, prompt, answer, EOS)
and tokenized with character offsets (``tokens.tokenize``). Bad pairs are refused, naming file and line:
an empty answer, a chosen answer identical to the rejected one, a prompt that fills the whole block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.config import ConfigError
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.sft.config import Overlong, TrainOn
from app.tasks.sft.conversations import BadRow, Conversation, Plain, messages
from app.tasks.sft.records import Places, batch_rows, row_record
from app.tasks.sft.spans import Formatted, SpanFinder, UnusableTemplate
from app.tasks.sft.tokens import tokenize

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class PairFields:
    """The columns a run reads, and what it does with an answer longer than the block (picklable for
    ``datasets.map``)."""

    prompt: str
    chosen: str
    rejected: str
    block_size: int
    overlong: Overlong
    places: Places
    """How the split's rows are named in messages (its file, and line, row or byte)."""

    def where(self, place: int) -> str:
        return self.places.where(place)


def read_pair(row: dict[str, Any], fields: PairFields) -> tuple[Conversation | Plain, Conversation | Plain]:
    """The chosen and the rejected side of a row, each a prompt and its answer; BadRow if unusable."""
    chosen, rejected = row[fields.chosen], row[fields.rejected]
    if chosen == rejected:
        raise BadRow(f"the {fields.chosen!r} and {fields.rejected!r} answers are identical")
    prompt = row.get(fields.prompt) if fields.prompt in row else None
    if prompt is None:
        prompt, chosen, rejected = split_implicit(chosen, rejected, fields)
    kinds = {type(v) for v in (prompt, chosen, rejected)}
    sides: list[Conversation | Plain]
    if kinds == {str}:
        sides = [Plain(prompt, answer) for answer in (chosen, rejected)]
        if not all(isinstance(side, Plain) and side.completion.strip() for side in sides):
            raise BadRow(f"the {_empty(chosen, rejected, fields)} answer is empty")
    elif kinds == {list}:
        turns = messages(prompt, fields.prompt)
        answers = [messages(a, f) for a, f in ((chosen, fields.chosen), (rejected, fields.rejected))]
        for answer, name in zip(answers, (fields.chosen, fields.rejected), strict=True):
            if not any(m["role"] == "assistant" for m in answer):
                raise BadRow(f"the {name!r} answer has no assistant turn")
            if not all(str(m.get("content", "")).strip() or m.get("tool_calls") for m in answer
                       if m["role"] == "assistant"):
                raise BadRow(f"the {name!r} answer is empty")
        sides = [Conversation(turns + answer, len(turns)) for answer in answers]
    else:
        raise BadRow(f"{fields.prompt!r}, {fields.chosen!r} and {fields.rejected!r} must be all strings or all lists "
                     "of messages")
    return sides[0], sides[1]


def _empty(chosen: str, rejected: str, fields: PairFields) -> str:
    return repr(fields.chosen) if not chosen.strip() else repr(fields.rejected)


def split_implicit(chosen: Any, rejected: Any, fields: PairFields) -> tuple[Any, Any, Any]:
    """Two whole conversations (or strings) -> the prompt they share and the two answers."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise BadRow(f"{fields.chosen!r} and {fields.rejected!r} share no prompt (their first messages differ), "
                         f"and there is no {fields.prompt!r} column")
        return chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(chosen, str) and isinstance(rejected, str):
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        return chosen[:shared], chosen[shared:], rejected[shared:]
    raise BadRow(f"{fields.chosen!r} and {fields.rejected!r} must be both strings or both lists of messages")


def one_sequence(formatted: list[Formatted]) -> Formatted:
    """A side of a pair is one sequence: an answer whose earlier turns the template rewrites once later ones
    follow (which sft learns turn by turn, in rows of their own) cannot be scored as one."""
    if len(formatted) != 1:
        raise BadRow("the chat template rewrites an earlier turn of its answer once later turns follow, so the answer "
                     "cannot be scored as one sequence")
    return formatted[0]


def encode_pairs(batch: dict[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase,
                 fields: PairFields) -> dict[str, list]:
    """A ``datasets.map`` batch -> ``chosen_ids``, ``chosen_labels``, ``rejected_ids``, ``rejected_labels``
    (-100: not learnt) and ``cut`` (1: an answer cut at block_size). Bad pairs are refused naming their line."""
    finder = SpanFinder(tokenizer, TrainOn.assistant)
    rows = batch_rows(batch)
    places = [fields.places.place(row, index) for index, row in zip(indices, rows, strict=True)]
    formatted: list[Formatted] = []
    for place, row in zip(places, rows, strict=True):
        try:
            formatted.extend(one_sequence(finder(side)) for side in read_pair(row_record(row), fields))
        except BadRow as err:
            raise ConfigError(f"{fields.where(place)}: {err}.") from None
        except UnusableTemplate as err:
            raise ConfigError(f"The chat template cannot be trained on: {err} ({fields.where(place)}); give "
                              "task.chat_template=chatml or a Jinja file.") from None
    encoded = tokenize(tokenizer, formatted)
    out: dict[str, list] = {"chosen_ids": [], "chosen_labels": [], "rejected_ids": [], "rejected_labels": [], "cut": []}
    for k, index in enumerate(places):
        cut = 0
        for side, (ids, labels) in zip(SIDES, encoded[2 * k:2 * k + 2], strict=True):
            prompt = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
            if prompt >= fields.block_size:
                raise ConfigError(f"{fields.where(index)}: its prompt is {prompt} tokens long, leaving no room for the "
                                  f"{side} answer in task.block_size={fields.block_size}; give a larger block_size or "
                                  "a shorter prompt.")
            if len(ids) > fields.block_size:
                if fields.overlong is Overlong.refuse:
                    raise ConfigError(f"{fields.where(index)}: its {side} side is {len(ids)} tokens long, more than "
                                      f"task.block_size={fields.block_size} (task.overlong=refuse); give a larger "
                                      "block_size or task.overlong=truncate.")
                ids, labels, cut = ids[:fields.block_size], labels[:fields.block_size], 1
            out[f"{side}_ids"].append(ids)
            out[f"{side}_labels"].append(labels)
        out["cut"].append(cut)
    return out
