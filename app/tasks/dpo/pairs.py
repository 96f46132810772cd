"""One row of preference data as two formatted texts, chosen and rejected, and their token rows.

A row is explicit (``prompt``, ``chosen``, ``rejected``: three strings, or three lists of messages) or
has an implicit prompt (``chosen`` and ``rejected`` only, two whole conversations, or two strings, that
begin alike: the prompt is what they share, the messages up to the first that differs). Mixed kinds are
made conversations (``one_kind``): a string prompt with conversations that repeat it (UltraFeedback-
binarized) or that do not, a conversation prompt with string answers. Other columns are ignored. Each side is
formatted as ``task=sft`` formats a prompt/completion pair (``spans.SpanFinder``: the chat template, the
answer's assistant turns learnt with their end-of-turn token; plain strings: BOS, prompt, answer, EOS)
and tokenized with character offsets (``tokens.tokenize``), then fitted into the block (``fit.py``: long
prompts cut, answers cut at the block's end, or the pair dropped). A bad pair's refusal names its file
and line (an empty answer, a chosen answer identical to the rejected one, a side longer than the block
with ``task.overlong=refuse``): returned in an ``error`` column, as ``tokens.encode_rows`` returns a bad
row's. A task that reads a number per pair besides (task=reward_model's ``margin``) names its column in
``PairFields.margin``: a row without it (or with null) has 0, one with something else than a number is bad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.tasks.dpo.config import DPOConfig
from app.tasks.dpo.fit import Fitted, PairFit, fit_pair
from app.tasks.sft.bad_rows import Skipped, skipped_of
from app.tasks.sft.config import TrainOn
from app.tasks.sft.conversations import BadRow, Conversation, Plain, messages, tools
from app.tasks.sft.records import PLACE, RECORD, Places, batch_rows, raw_text, row_record
from app.tasks.sft.spans import Formatted, SpanFinder, UnusableTemplate
from app.tasks.sft.tokens import tokenize

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase
    from typing_extensions import Self

SIDES = ("chosen", "rejected")
COUNTS = ("prompt_cut", "answer_cut", "dropped")
"""What ``fit.fit_pair`` did to each pair (1 or 0), columns of :func:`encode_pairs`, counted in the log."""


@dataclass(frozen=True)
class PairFields:
    """The columns a run reads, how it fits a pair into the block, and the split's file (picklable for
    ``datasets.map``)."""

    prompt: str
    chosen: str
    rejected: str
    fit: PairFit
    places: Places
    """How the split's rows are named in messages (its file, and line, row or byte)."""
    tools: str = "tools"
    """The column of function schemas given to the chat template (``task.tools_field``)."""
    margin: str | None = None
    """A column of one number per pair, carried with it as ``margin`` (task=reward_model's
    ``task.margin_field``); None: nothing more is read."""

    @classmethod
    def of(cls, cfg: DPOConfig, places: Places) -> Self:
        return cls(cfg.prompt_field, cfg.chosen_field, cfg.rejected_field, PairFit.of(cfg), places, cfg.tools_field)

    def where(self, place: int) -> str:
        return self.places.where(place)


def read_pair(row: dict[str, Any], fields: PairFields) -> tuple[Conversation | Plain, Conversation | Plain]:
    """The chosen and the rejected side of a row, each a prompt and its answer; BadRow if unusable.
    Columns other than the three are not read."""
    chosen, rejected = row.get(fields.chosen), row.get(fields.rejected)
    for name, value in ((fields.chosen, chosen), (fields.rejected, rejected)):
        if value is None:
            raise BadRow(f"it has no {name!r}")
    if chosen == rejected:
        raise BadRow(f"the {fields.chosen!r} and {fields.rejected!r} answers are identical")
    prompt = row.get(fields.prompt) if fields.prompt in row else None
    if prompt is None:
        prompt, chosen, rejected = split_implicit(chosen, rejected, fields)
    prompt, chosen, rejected = one_kind(prompt, chosen, rejected, fields)
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
        schemas = tools(row, fields.tools)
        sides = [Conversation(turns + answer, len(turns), schemas) for answer in answers]
    else:
        raise BadRow(f"{fields.prompt!r}, {fields.chosen!r} and {fields.rejected!r} must be strings or lists of "
                     "messages")
    return sides[0], sides[1]


def margin_of(row: dict[str, Any], name: str) -> float:
    """A row's number in column ``name``: 0 where it has none (absent or null); BadRow for anything but a
    finite number."""
    value = row.get(name)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRow(f"its {name!r} is not a finite number (it is {value!r})")
    return float(value)


def one_kind(prompt: Any, chosen: Any, rejected: Any, fields: PairFields) -> tuple[Any, Any, Any]:
    """A prompt and answers of mixed kinds as three lists of messages: a string prompt with conversations
    as answers is the user turn they begin with (UltraFeedback-binarized's layout: the prompt is the
    messages they share, which must hold it), else a user turn before them; a conversation with string
    answers gets each as one assistant turn. Other kinds are returned as they are."""
    if isinstance(prompt, list) and isinstance(chosen, str) and isinstance(rejected, str):
        return prompt, [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
    if not (isinstance(prompt, str) and isinstance(chosen, list) and isinstance(rejected, list)):
        return prompt, chosen, rejected
    shared = shared_turns(chosen, rejected)
    turns = chosen[:shared]
    said = [m.get("content") for m in turns if isinstance(m, dict) and m.get("role") == "user"]
    if not said:
        return [*turns, {"role": "user", "content": prompt}], chosen[shared:], rejected[shared:]
    if not any(not isinstance(content, str) or content.strip() == prompt.strip() for content in said):
        raise BadRow(f"the {fields.prompt!r} string is none of the user turns that {fields.chosen!r} and "
                     f"{fields.rejected!r} begin with")
    return turns, chosen[shared:], rejected[shared:]


def conversational(row: dict[str, Any], prompt_field: str, chosen_field: str) -> bool:
    """Whether a row goes through the chat template: its prompt or its chosen answer is a list of messages."""
    return isinstance(row.get(prompt_field), list) or isinstance(row.get(chosen_field), list)


def shared_turns(chosen: list[Any], rejected: list[Any]) -> int:
    """How many messages two conversations begin with alike."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return shared


def _empty(chosen: str, rejected: str, fields: PairFields) -> str:
    return repr(fields.chosen) if not chosen.strip() else repr(fields.rejected)


def split_implicit(chosen: Any, rejected: Any, fields: PairFields) -> tuple[Any, Any, Any]:
    """Two whole conversations (or strings) -> the prompt they share and the two answers."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        shared = shared_turns(chosen, rejected)
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


def encode_pairs(batch: dict[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase,
                 fields: PairFields) -> dict[str, list]:
    """A ``datasets.map`` batch -> ``chosen_ids``, ``chosen_labels``, ``rejected_ids``, ``rejected_labels``
    (-100: not learnt), fitted into the block (``fit.fit_pair``); ``prompt_cut``, ``answer_cut`` and
    ``dropped`` (1: what was done to the pair; a dropped pair's lists are empty) and ``error``: why a bad
    pair is refused, naming its place (empty for a good pair; a bad one's lists are empty), with ``place`` and
    ``raw`` (the row as it came, for a bad one) for ``bad_rows``; and ``margin`` where ``fields.margin`` names its
    column (:func:`margin_of`). Errors are returned, not raised, as
    ``tokens.encode_rows`` returns them: raised in one of ``task.num_proc`` processes, the pool would be torn down
    mid-work."""
    finder = SpanFinder(tokenizer, TrainOn.assistant)
    rows = batch_rows(batch)
    places = [fields.places.place(row, index) for index, row in zip(indices, rows, strict=True)]
    formatted: list[Formatted] = []
    errors: list[str] = []
    margins: list[float] = []
    for place, row in zip(places, rows, strict=True):
        margins.append(0.0)
        try:
            record = row_record(row)
            sides = read_pair(record, fields)
            margins[-1] = margin_of(record, fields.margin) if fields.margin is not None else 0.0
            formatted.extend([one_sequence(finder(side)) for side in sides])
            errors.append("")
        except BadRow as err:
            errors.append(f"{fields.where(place)}: {err}.")
        except UnusableTemplate as err:
            errors.append(f"The chat template cannot be trained on: {err} ({fields.where(place)}); give "
                          "task.chat_template=chatml or a Jinja file.")
    encoded = iter(tokenize(tokenizer, formatted))
    out: dict[str, list] = {"chosen_ids": [], "chosen_labels": [], "rejected_ids": [], "rejected_labels": [],
                            **{count: [] for count in COUNTS}, "error": errors, "place": places, "raw": []}
    for k, (place, row) in enumerate(zip(places, rows, strict=True)):
        fitted = Fitted([])  # a bad pair: no sides
        if not errors[k]:
            try:
                fitted = fit_pair([next(encoded), next(encoded)], fields.fit, tokenizer.bos_token_id)
            except BadRow as err:
                errors[k] = f"{fields.where(place)}: {err}."
        for side, (ids, labels) in zip(SIDES, fitted.sides or [([], []), ([], [])], strict=True):
            out[f"{side}_ids"].append(ids)
            out[f"{side}_labels"].append(labels)
        for count in COUNTS:
            out[count].append(int(getattr(fitted, count)))
        out["raw"].append(raw_text(row) if errors[k] else "")
    if fields.margin is not None:
        out["margin"] = margins
    return out


def bad_pairs(texts: list[str], offsets: list[int], tokenizer: PreTrainedTokenizerBase,
              fields: PairFields) -> list[Skipped]:
    """The bad pairs among a stream's records (their lines' texts and byte offsets)."""
    return skipped_of(encode_pairs({RECORD: texts, PLACE: offsets}, list(range(len(texts))), tokenizer, fields),
                      fields.places)


def one_sequence(formatted: list[Formatted]) -> Formatted:
    """A side of a pair is one sequence: an answer whose earlier turns the template rewrites once later ones
    follow (which sft learns turn by turn, in rows of their own) cannot be scored as one."""
    if len(formatted) != 1:
        raise BadRow("the chat template rewrites an earlier turn of its answer once later turns follow, so the answer "
                     "cannot be scored as one sequence")
    return formatted[0]


def pair_features(margin: bool = False) -> datasets.Features:
    """The columns of :func:`encode_pairs` (``margin``: with its ``margin`` column), given to ``datasets.map`` so
    a batch of bad pairs (empty lists) does not make it infer another type for them."""
    from datasets import Features, List, Value

    return Features({**{f"{side}_{part}": List(Value("int64")) for side in SIDES for part in ("ids", "labels")},
                     **{count: Value("int64") for count in COUNTS}, "error": Value("string"), "place": Value("int64"),
                     "raw": Value("string"), **({"margin": Value("float64")} if margin else {})})
