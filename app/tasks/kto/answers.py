"""A row of ``task=kto`` data as its labelled answers, tokenized, and each answer's mismatched KL sequence.

A row is TRL's unpaired format (``prompt``, ``completion``, ``label``: true for a desirable answer, false
for an undesirable one; strings, or lists of messages formatted by the chat template, mixed as task=dpo
mixes them), or a preference pair (``prompt``/``chosen``/``rejected``, or an implicit prompt), read as
task=dpo reads it and made into two answers: the chosen one desirable, the rejected one undesirable. The
answers are formatted, tokenized and fitted into the block as task=dpo's sides are (``dpo/pairs.py``,
``dpo/fit.py``); a bad row's refusal names its file and place, in an ``error`` column judged by
``task.bad_rows``.

KL sequences (the KL estimate z, KTO paper §4): answer i's prompt followed by another answer j's tokens
(the answer's first learnt token on; TRL joins the token ids the same way), cut at the block. The partner
j is drawn once for the split (a seeded shuffle, each answer followed by the next in it, skipping answers
to the same prompt: a pair's two answers are never each other's), so the sequences are the same whatever
the batch size, the accumulation or the processes; a stream draws them within each read-ahead of records.
TRL instead rotates the answers within each batch of ``per_device_train_batch_size``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.dpo.fit import Fitted, PairFit, fit_pair
from app.tasks.dpo.pairs import COUNTS, PairFields, answered, formatted_rows, one_kind, read_pair
from app.tasks.sft.bad_rows import Skipped, skipped_of
from app.tasks.sft.conversations import BadRow, Conversation, Plain
from app.tasks.sft.records import PLACE, RECORD, Places, batch_rows, raw_text
from app.tasks.sft.tokens import tokenize

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase
    from typing_extensions import Self

    from app.tasks.kto.config import KTOConfig

SIDES = ("answer", "kl")
"""An item's two rows: the answer, and its KL sequence."""
ANSWER = ("answer_ids", "answer_labels")


@dataclass(frozen=True)
class AnswerFields:
    """The columns a run reads, how it fits an answer into the block, and the split's file (picklable
    for ``datasets.map``)."""

    prompt: str
    completion: str
    label: str
    pairs: PairFields
    """How a paired row is read (``task.chosen_field``, ``task.rejected_field``)."""

    @classmethod
    def of(cls, cfg: KTOConfig, places: Places) -> Self:
        return cls(cfg.prompt_field, cfg.completion_field, cfg.label_field, PairFields.of(cfg, places))

    @property
    def fit(self) -> PairFit:
        return self.pairs.fit

    @property
    def places(self) -> Places:
        return self.pairs.places


def desirable(value: Any, column: str) -> bool:
    """A label as TRL's: a boolean (0 and 1 too); BadRow for anything else."""
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise BadRow(f"its {column!r} is {value!r}, not true or false")


def labelled(row: dict[str, Any], fields: AnswerFields) -> list[tuple[Conversation | Plain, bool]]:
    """A row's answers, each with whether it is desirable: an unpaired row's one (it has the label's
    column), a pair's two; BadRow if unusable."""
    if fields.label not in row:
        chosen, rejected = read_pair(row, fields.pairs)
        return [(chosen, True), (rejected, False)]
    good = desirable(row[fields.label], fields.label)
    prompt, completion = row.get(fields.prompt), row.get(fields.completion)
    for name, value in ((fields.prompt, prompt), (fields.completion, completion)):
        if value is None:
            raise BadRow(f"it has no {name!r}")
    prompt, (answer,) = one_kind(prompt, [completion], (fields.completion,), fields.prompt)
    (side,) = answered(prompt, [(fields.completion, answer)], row, fields.prompt, fields.pairs.tools)
    return [(side, good)]


def encode_answers(batch: dict[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase,
                   fields: AnswerFields) -> dict[str, list]:
    """A ``datasets.map`` batch -> one row per answer (``answer_ids``, ``answer_labels``: -100 where not
    learnt; ``label``: 1 desirable, 0 undesirable), fitted into the block (a pair's two alike, as task=dpo
    fits them), with ``prompt_cut``, ``answer_cut``, ``dropped``, and, for a bad row, one row with its
    ``error`` (naming its place), its ``place`` and ``raw`` text (``bad_rows``): as ``pairs.encode_pairs``."""
    out: dict[str, list] = {"answer_ids": [], "answer_labels": [], "label": [], **{c: [] for c in COUNTS},
                            "error": [], "place": [], "raw": []}

    def emit(fitted: Fitted, good: bool, error: str, place: int, row: dict[str, Any]) -> None:
        ids, labels = fitted.sides[0] if fitted.sides else ([], [])
        out["answer_ids"].append(ids)
        out["answer_labels"].append(labels)
        out["label"].append(int(good))
        for count in COUNTS:
            out[count].append(int(getattr(fitted, count)))
        out["error"].append(error)
        out["place"].append(place)
        out["raw"].append(raw_text(row) if error else "")

    rows = batch_rows(batch)
    places = [fields.places.place(row, index) for index, row in zip(indices, rows, strict=True)]
    formatted, read = formatted_rows(rows, places, fields.places, tokenizer, lambda record: labelled(record, fields))
    encoded = iter(tokenize(tokenizer, formatted))
    for place, row, found in zip(places, rows, read, strict=True):
        if isinstance(found, str):
            emit(Fitted([]), False, found, place, row)
            continue
        answers = found
        sides = [next(encoded) for _ in answers]
        names = (fields.pairs.chosen, fields.pairs.rejected) if len(answers) == 2 else (fields.completion,)
        try:
            fitted = fit_pair(sides, fields.fit, tokenizer.bos_token_id, names)
        except BadRow as err:
            emit(Fitted([]), False, f"{fields.places.where(place)}: {err}.", place, row)
            continue
        for k, (_, good) in enumerate(answers):
            side = [fitted.sides[k]] if fitted.sides else []
            emit(Fitted(side, fitted.prompt_cut, fitted.answer_cut, fitted.dropped), good, "", place, row)
    return out


def bad_answers(texts: list[str], offsets: list[int], tokenizer: PreTrainedTokenizerBase,
                fields: AnswerFields) -> list[Skipped]:
    """The bad rows among a stream's records (their lines' texts and byte offsets)."""
    return skipped_of(encode_answers({RECORD: texts, PLACE: offsets}, list(range(len(texts))), tokenizer, fields),
                      fields.places)


def answer_features() -> datasets.Features:
    """The columns of :func:`encode_answers`, for ``datasets.map``."""
    from datasets import Features, List, Value

    return Features({**{column: List(Value("int64")) for column in ANSWER}, "label": Value("int64"),
                     **{count: Value("int64") for count in COUNTS}, "error": Value("string"), "place": Value("int64"),
                     "raw": Value("string")})


def answer_start(labels: list[int]) -> int:
    """Where the answer starts: its first learnt token (the whole row when nothing is learnt)."""
    return next((k for k, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def partners(prompts: list[tuple[int, ...]], seed: int) -> list[int]:
    """For each answer, the answer whose tokens its KL sequence takes: the next one in a seeded shuffle,
    or the one after where that one answers the same prompt (a lone answer takes its own)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    chosen = [0] * len(order)
    for k, i in enumerate(order):
        step = next((s for s in range(1, len(order)) if prompts[order[(k + s) % len(order)]] != prompts[i]), 1)
        chosen[i] = order[(k + step) % len(order)]
    return chosen


def kl_rows(ids: list[list[int]], labels: list[list[int]], block_size: int, seed: int) -> tuple[list, list]:
    """Each answer's KL sequence: its prompt, then its partner's answer (:func:`partners`), cut at the block."""
    starts = [answer_start(row) for row in labels]
    others = partners([tuple(row[:start]) for row, start in zip(ids, starts, strict=True)], seed)
    kl_ids, kl_labels = [], []
    for i, j in enumerate(others):
        kl_ids.append((ids[i][:starts[i]] + ids[j][starts[j]:])[:block_size])
        kl_labels.append(([IGNORE_INDEX] * starts[i] + labels[j][starts[j]:])[:block_size])
    return kl_ids, kl_labels


def with_kl(items: datasets.Dataset, block_size: int, seed: int) -> datasets.Dataset:
    """A split's answers with their KL sequences (``kl_ids``, ``kl_labels``)."""
    kl_ids, kl_labels = kl_rows(items["answer_ids"], items["answer_labels"], block_size, seed)
    return items.add_column("kl_ids", kl_ids).add_column("kl_labels", kl_labels)


def stream_answers(texts: list[str], offsets: list[int], tokenizer: PreTrainedTokenizerBase, fields: AnswerFields,
                   seed: int) -> list[dict[str, Any]]:
    """A read-ahead's answers with their KL sequences (partners drawn within it), each named by its line's
    byte offset × 2 + its place in the row (a pair's rejected answer: + 1); bad and dropped rows left out."""
    out = encode_answers({RECORD: texts, PLACE: offsets}, list(range(len(texts))), tokenizer, fields)
    keep = [k for k in range(len(out["error"])) if not out["dropped"][k] and not out["error"][k]]
    ids, labels = [out["answer_ids"][k] for k in keep], [out["answer_labels"][k] for k in keep]
    kl_ids, kl_labels = kl_rows(ids, labels, fields.fit.block_size, seed + (offsets[0] if offsets else 0))
    second = [k > 0 and out["place"][k] == out["place"][k - 1] for k in range(len(out["place"]))]
    return [{"answer_ids": ids[n], "answer_labels": labels[n], "kl_ids": kl_ids[n], "kl_labels": kl_labels[n],
             "label": out["label"][k], "pair": 2 * out["place"][k] + int(second[k])} for n, k in enumerate(keep)]
