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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.tasks.dpo.config import PreferenceConfig
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
    def of(cls, cfg: PreferenceConfig, places: Places) -> Self:
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
    names = (fields.chosen, fields.rejected)
    prompt, answers = one_kind(prompt, [chosen, rejected], names, fields.prompt)
    sides = answered(prompt, list(zip(names, answers, strict=True)), row, fields.prompt, fields.tools)
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


def answered(prompt: Any, answers: list[tuple[str, Any]], row: dict[str, Any], prompt_field: str,
             tools_field: str) -> list[Conversation | Plain]:
    """The prompt with each of its answers (``(column, answer)``), one side each: three strings (BOS,
    prompt, answer, EOS) or lists of messages (through the chat template, the row's tools given to it);
    BadRow if unusable (an empty answer, one without an assistant turn, kinds that do not go together)."""
    kinds = {type(prompt)} | {type(answer) for _, answer in answers}
    if kinds == {str}:
        for name, answer in answers:
            if not answer.strip():
                raise BadRow(f"the {name!r} answer is empty")
        return [Plain(prompt, answer) for _, answer in answers]
    if kinds == {list}:
        turns = messages(prompt, prompt_field)
        conversations = [(messages(answer, name), name) for name, answer in answers]
        for answer, name in conversations:
            if not any(m["role"] == "assistant" for m in answer):
                raise BadRow(f"the {name!r} answer has no assistant turn")
            if not all(str(m.get("content", "")).strip() or m.get("tool_calls") for m in answer
                       if m["role"] == "assistant"):
                raise BadRow(f"the {name!r} answer is empty")
        schemas = tools(row, tools_field)
        return [Conversation(turns + answer, len(turns), schemas) for answer, _ in conversations]
    columns = [repr(prompt_field), *(repr(name) for name, _ in answers)]
    raise BadRow(f"{', '.join(columns[:-1])} and {columns[-1]} must be strings or lists of messages")


def one_kind(prompt: Any, answers: list[Any], names: tuple[str, ...], prompt_field: str) -> tuple[Any, list[Any]]:
    """A prompt and answers of mixed kinds as lists of messages: a string prompt with conversations as
    answers is the user turn they begin with (UltraFeedback-binarized's layout: the prompt is the
    messages the answers share, or a single answer's turns before its first assistant turn, which must
    hold it), else a user turn before them; a conversation with string answers gets each as one
    assistant turn. Other kinds are returned as they are."""
    if isinstance(prompt, list) and all(isinstance(a, str) for a in answers):
        return prompt, [[{"role": "assistant", "content": a}] for a in answers]
    if not (isinstance(prompt, str) and all(isinstance(a, list) for a in answers)):
        return prompt, answers
    if len(answers) > 1:
        shared = min(shared_turns(answers[0], other) for other in answers[1:])
    else:
        shared = next((k for k, m in enumerate(answers[0]) if isinstance(m, dict) and m.get("role") == "assistant"),
                      len(answers[0]))
    turns = answers[0][:shared]
    said = [m.get("content") for m in turns if isinstance(m, dict) and m.get("role") == "user"]
    if not said:
        return [*turns, {"role": "user", "content": prompt}], [a[shared:] for a in answers]
    if not any(not isinstance(content, str) or content.strip() == prompt.strip() for content in said):
        columns = [repr(name) for name in names]
        who = f"{', '.join(columns[:-1])} and {columns[-1]} begin" if len(columns) > 1 else f"{columns[0]} begins"
        raise BadRow(f"the {prompt_field!r} string is none of the user turns that {who} with")
    return turns, [a[shared:] for a in answers]


def conversational(row: dict[str, Any], prompt_field: str, chosen_field: str) -> bool:
    """Whether a row goes through the chat template: its prompt or its chosen answer is a list of messages."""
    return isinstance(row.get(prompt_field), list) or isinstance(row.get(chosen_field), list)


def shared_turns(chosen: list[Any], rejected: list[Any]) -> int:
    """How many messages two conversations begin with alike."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return shared


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
    column (:func:`margin_of`; 0 for a bad pair). Errors are returned, not raised, as ``tokens.encode_rows``
    returns them: raised in one of ``task.num_proc`` processes, the pool would be torn down mid-work."""
    rows = batch_rows(batch)
    places = [fields.places.place(row, index) for index, row in zip(indices, rows, strict=True)]

    def read(record: dict[str, Any]) -> list[tuple[Conversation | Plain, float]]:
        sides = read_pair(record, fields)
        margin = margin_of(record, fields.margin) if fields.margin is not None else 0.0
        return [(side, margin) for side in sides]

    formatted, found = formatted_rows(rows, places, fields.places, tokenizer, read)
    errors = [f if isinstance(f, str) else "" for f in found]
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
        out["margin"] = [0.0 if isinstance(f, str) else float(f[0][1]) for f in found]
    return out


def formatted_rows(rows: list[dict[str, Any]], places: list[int], named: Places, tokenizer: PreTrainedTokenizerBase,
                   read: Callable[[dict[str, Any]], list[tuple[Conversation | Plain, Any]]]
                   ) -> tuple[list[Formatted], list[list[tuple[Conversation | Plain, Any]] | str]]:
    """Each row's sides (``read``: a record -> its sides, each with what goes with it) formatted through
    the template, all rows' in one list to tokenize at once; and per row its sides, or why it is bad (a
    sentence naming its place)."""
    finder = SpanFinder(tokenizer, TrainOn.assistant)
    formatted: list[Formatted] = []
    found: list[list[tuple[Conversation | Plain, Any]] | str] = []
    for place, row in zip(places, rows, strict=True):
        try:
            sides = read(row_record(row))
            formatted.extend(one_sequence(finder(side)) for side, _ in sides)
            found.append(sides)
        except BadRow as err:
            found.append(f"{named.where(place)}: {err}.")
        except UnusableTemplate as err:
            found.append(f"The chat template cannot be trained on: {err} ({named.where(place)}); give "
                         "task.chat_template=chatml or a Jinja file.")
    return formatted, found


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
