"""From rows to training rows: each row formatted (``spans.SpanFinder``: one text, or one per assistant turn
of a template that rewrites earlier turns), tokenized once with character offsets, and labelled: a token is
learnt (its label is its id) where it overlaps a learnt range, else its label is -100. A split is tokenized
by ``datasets.map`` (``task.num_proc`` processes, a progress bar, cached on disk under a key of everything
that changes the rows); then :class:`Tokenized` says what became of every row: trained on, bad (with its
place and reason, for ``bad_rows.py``), dropped with nothing to learn, cut at the block."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.config import ConfigError
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.sft.bad_rows import Skipped, skipped_of
from app.tasks.sft.config import DataFormat, Overlong, SFTConfig, TrainOn, TruncationMode
from app.tasks.sft.conversations import BadRow, Fields, read_row
from app.tasks.sft.records import PLACE, RECORD, Places, batch_rows, raw_text, row_record
from app.tasks.sft.render import Ranges
from app.tasks.sft.spans import Formatted, SpanFinder, TemplateTraits, UnusableTemplate
from app.tasks.sft.truncation import cut_prompt
from app.tasks.text.sources import Split
from app.tasks.text.task import digest
from app.tasks.text.tokenization import tokenizer_fingerprint

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

CACHE_VERSION = 3
"""Part of the cache key: bump it when ``encode_rows`` changes what it produces."""
KEPT_COLUMNS = ("input_ids", "labels", "source")


@dataclass(frozen=True)
class Recipe:
    """Everything besides the tokenizer and the data that decides a split's rows (picklable for the
    tokenizing processes, and the cache key)."""

    data_format: DataFormat
    fields: Fields
    train_on: TrainOn
    block_size: int
    overlong: Overlong
    places: Places
    """How the split's rows are named in messages (its file, and line, row or byte)."""
    traits: TemplateTraits | None = None
    """The chat template's end-of-turn token and generation prompt (``SpanFinder.probe``), found once."""
    max_prompt_length: int | None = None
    truncation_mode: TruncationMode = TruncationMode.keep_end

    @classmethod
    def of(cls, cfg: SFTConfig, data_format: DataFormat, fields: Fields, places: Places,
           traits: TemplateTraits | None) -> Recipe:
        return cls(data_format, fields, cfg.train_on, cfg.block_size, cfg.overlong, places, traits,
                   cfg.max_prompt_length, cfg.truncation_mode)

    def key(self) -> dict[str, Any]:
        """The recipe as part of a cache key (the file's name left out: its contents are keyed)."""
        return {**asdict(self), "places": self.places.unit}


def tokenize(tokenizer: PreTrainedTokenizerBase, formatted: list[Formatted]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each formatted text. Plain text gets the tokenizer's special tokens (BOS)
    and an EOS after it, learnt; a template's text carries its own."""
    out: list[tuple[list[int], list[int]]] = [([], [])] * len(formatted)
    eos = tokenizer.eos_token_id
    for plain in (True, False):
        group = [i for i, f in enumerate(formatted) if f.plain == plain]
        if not group:
            continue
        encoded = tokenizer([formatted[i].text for i in group], add_special_tokens=plain, return_offsets_mapping=True,
                            return_attention_mask=False, verbose=False)
        for i, ids, offsets in zip(group, encoded["input_ids"], encoded["offset_mapping"], strict=True):
            labels = learnt_labels(ids, offsets, formatted[i].learnt, len(formatted[i].text))
            if plain and eos is not None and (not ids or ids[-1] != eos):
                ids, labels = [*ids, eos], [*labels, eos]
            out[i] = (ids, labels)
    return out


def learnt_labels(ids: list[int], offsets: list[tuple[int, int]], ranges: Ranges, length: int) -> list[int]:
    """Each token's label: its id where it overlaps a learnt character range, else -100 (the special
    tokens a tokenizer adds have no extent, so are not learnt). Through the count of learnt characters
    before each position, so a token costs one comparison, not one per range."""
    learnt = bytearray(length + 1)
    for begin, end in ranges:
        learnt[begin:end] = b"\x01" * (end - begin)
    before = [0, *itertools.accumulate(learnt)]
    return [t if before[end] > before[begin] else IGNORE_INDEX for t, (begin, end) in zip(ids, offsets, strict=True)]


COLUMNS = ("input_ids", "labels", "learnt", "cut", "prompt_cut", "own_row", "disagreements", "source", "place", "error",
           "raw")


def encode_rows(batch: dict[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase,
                recipe: Recipe) -> dict[str, list]:
    """A ``datasets.map`` batch -> training rows (one or several per row: ``source`` is the row's index,
    ``place`` its line): ``input_ids``, ``labels``, ``learnt`` (tokens learnt; 0: dropped later), ``cut``
    (1: truncated to block_size), ``own_row`` (a turn the template rewrites later, in a row of its own),
    ``disagreements`` (turns the span finder places otherwise than the template's markers); a bad row is one
    row with its ``error`` (the sentence naming its place) and ``raw`` (the row as it came). Errors are
    returned, not raised: raised in one of ``task.num_proc`` processes, the pool would be torn down mid-work."""
    finder = SpanFinder(tokenizer, recipe.train_on, recipe.traits)
    out: dict[str, list] = {column: [] for column in COLUMNS}
    rows = batch_rows(batch)
    places = [recipe.places.place(row, index) for index, row in zip(indices, rows, strict=True)]
    formatted: list[list[Formatted] | str] = [_format(row, place, finder, recipe) for row, place in
                                              zip(rows, places, strict=True)]
    encoded = iter(tokenize(tokenizer, [f for group in formatted if not isinstance(group, str) for f in group]))
    for index, row, place, group in zip(indices, rows, places, formatted, strict=True):
        made = group if isinstance(group, str) else _rows(group, [next(encoded) for _ in group], place, recipe,
                                                          tokenizer.bos_token_id)
        if isinstance(made, str):  # refused: one row saying why
            made = [{"input_ids": [], "labels": [], "learnt": 0, "cut": 0, "prompt_cut": 0, "own_row": 0,
                     "disagreements": 0, "error": made, "raw": raw_text(row)}]
        base = {"source": index, "place": place, "error": "", "raw": ""}
        for made_row in made:
            full = {**base, **made_row}
            for column in COLUMNS:
                out[column].append(full[column])
    return out


def _format(row: dict[str, Any], place: int, finder: SpanFinder, recipe: Recipe) -> list[Formatted] | str:
    """The row's formatted texts, or why it is refused (a sentence naming its place)."""
    where = recipe.places.where(place)
    try:
        return finder(read_row(row_record(row), recipe.data_format, recipe.fields))
    except BadRow as err:
        return f"{where}: {err}."
    except UnusableTemplate as err:
        return (f"The chat template cannot be trained on with task.train_on={recipe.train_on.value}: {err} "
                f"({where}); give task.chat_template=chatml or a Jinja file.")


def _rows(group: list[Formatted], encoded: list[tuple[list[int], list[int]]], place: int, recipe: Recipe,
          bos: int | None) -> list[dict[str, Any]] | str:
    """A row's training rows, a prompt/completion pair's prompt cut to ``task.max_prompt_length``, then cut at
    the block; or, with ``task.overlong=refuse``, why it is refused."""
    made = []
    for formatted, (whole_ids, whole_labels) in zip(group, encoded, strict=True):
        ids, labels = whole_ids, whole_labels
        if recipe.max_prompt_length is not None and recipe.data_format is DataFormat.prompt_completion:
            ids, labels = cut_prompt(ids, labels, recipe.max_prompt_length, recipe.truncation_mode, bos)
        prompt_cut = len(ids) < len(whole_ids)
        cut = len(ids) > recipe.block_size
        if cut and recipe.overlong is Overlong.refuse:
            return (f"{recipe.places.where(place)} is {len(ids)} tokens long, more than task.block_size="
                    f"{recipe.block_size} (task.overlong=refuse); give a larger block_size or task.overlong="
                    "truncate or drop.")
        if cut:
            ids, labels = ids[:recipe.block_size], labels[:recipe.block_size]
        learnt = 0 if cut and recipe.overlong is Overlong.drop else len(labels) - labels.count(IGNORE_INDEX)
        made.append({"input_ids": ids, "labels": labels, "learnt": learnt, "cut": int(cut), "prompt_cut": int(prompt_cut),
                     "own_row": int(formatted.own_row), "disagreements": formatted.disagreements})
    return made


def row_features() -> datasets.Features:
    """The columns of :func:`encode_rows`, given to ``datasets.map`` so it need not infer them batch by batch
    (a scan of every value); the types it infers (``input_ids`` narrowed to int32, as datasets does)."""
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value("int32")), "labels": List(Value("int64")), "learnt": Value("int64"),
                     "cut": Value("int64"), "prompt_cut": Value("int64"), "own_row": Value("int64"), "disagreements": Value("int64"),
                     "source": Value("int64"), "place": Value("int64"), "error": Value("string"),
                     "raw": Value("string")})


@dataclass
class Tokenized:
    """A split's training rows and what became of its rows (conversations, pairs...), each counted once."""

    rows: Any
    """The rows with something learnt: ``input_ids``, ``labels``, ``source`` (the row they come from)."""
    origin: str
    read: int
    """Rows read, bad ones included."""
    bad: list[Skipped] = field(default_factory=list)
    dropped: int = 0
    """Good rows with nothing to learn (task.train_on finds no token in them, or all was cut away)."""
    cut: int = 0
    """Good rows kept with a part cut at the block (task.overlong=truncate)."""
    prompt_cut: int = 0
    """Good rows kept with their prompt cut to task.max_prompt_length."""
    too_long: int = 0
    """Good rows left out for being longer than the block (task.overlong=drop)."""
    own_rows: int = 0
    """Rows whose template rewrites an earlier turn: its turns learnt in rows of their own."""
    disagreements: int = 0
    """Turns where the span finder and the template's generation markers differ (the markers win)."""

    @property
    def kept(self) -> int:
        return self.read - len(self.bad) - self.dropped - self.too_long


def summarise(rows: Any, places: Places, overlong: Overlong) -> Tokenized:
    """What :func:`encode_rows` made of a split: the good rows with something learnt, the counts, the bad rows."""
    # Read as lists once: a Dataset's column is read row by row where it is indexed (a datasets call per row).
    columns = rows.select_columns(["error", "learnt", "cut", "own_row", "source", "prompt_cut", "place", "raw",
                                   "disagreements"]).to_dict()
    error, learnt, cut, own, source, prompt_cut = (columns[c] for c in ("error", "learnt", "cut", "own_row", "source",
                                                                        "prompt_cut"))
    bad = skipped_of(columns, places)
    by_source: dict[int, list[int]] = {}
    for i, s in enumerate(source):
        if not error[i]:
            by_source.setdefault(s, []).append(i)
    summary = Tokenized(None, places.origin, len(by_source) + len(bad), bad, disagreements=sum(columns["disagreements"]))
    for members in by_source.values():
        if overlong is Overlong.drop and any(cut[i] for i in members):
            summary.too_long += 1
        elif not any(learnt[i] for i in members):
            summary.dropped += 1
        else:
            summary.cut += any(cut[i] for i in members)
            summary.prompt_cut += any(prompt_cut[i] for i in members)
            summary.own_rows += any(own[i] for i in members)
    kept = [i for i, n in enumerate(learnt) if n > 0 and not error[i]
            and not (overlong is Overlong.drop and any(cut[j] for j in by_source[source[i]]))]
    summary.rows = (rows if len(kept) == len(rows) else rows.select(kept)).select_columns(list(KEPT_COLUMNS))
    return summary


def tokenize_split(split: Split, places: Places, name: str, tokenizer: PreTrainedTokenizerBase, cfg: SFTConfig,
                   data_format: DataFormat, fields: Fields, traits: TemplateTraits | None,
                   cache_dir: Path | None) -> Tokenized:
    """The split's rows encoded (cached) and summarised."""
    recipe = Recipe.of(cfg, data_format, fields, places, traits)
    payload = {"version": CACHE_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer),
               "template": tokenizer.chat_template, "recipe": recipe.key(), "data": split.fingerprint}
    key = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
    cached: dict[str, Any] = {}
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cached = {"cache_file_name": str(cache_dir / f"sft-{name}-{key}.arrow"), "load_from_cache_file": True}
    rows = split.data.map(functools.partial(encode_rows, tokenizer=tokenizer, recipe=recipe), batched=True,
                          with_indices=True, remove_columns=split.data.column_names, new_fingerprint=key,
                          features=row_features(),
                          num_proc=cfg.num_proc if len(split.data) >= 2 * cfg.num_proc > 2 else None,
                          desc=f"Tokenizing {cfg.name} {name}", **cached)
    return summarise(rows, places, cfg.overlong)


def encode_texts(texts: list[str], offsets: list[int], tokenizer: PreTrainedTokenizerBase,
                 recipe: Recipe) -> list[dict[str, list[int]]]:
    """A stream's records (their lines' texts and byte offsets) -> training rows, as the map-style split's;
    bad rows (found and judged before training: ``SFTTask._check_stream``) and rows with nothing learnt
    left out."""
    out = encode_rows({RECORD: texts, PLACE: offsets}, list(range(len(texts))), tokenizer, recipe)
    return [{"input_ids": ids, "labels": labels} for ids, labels, learnt, error
            in zip(out["input_ids"], out["labels"], out["learnt"], out["error"], strict=True) if learnt > 0 and not error]


def bad_records(texts: list[str], offsets: list[int], tokenizer: PreTrainedTokenizerBase,
                recipe: Recipe) -> list[Skipped]:
    """The bad rows among a stream's records, as the map-style split's are found."""
    return skipped_of(encode_rows({RECORD: texts, PLACE: offsets}, list(range(len(texts))), tokenizer, recipe),
                      recipe.places)


def sources(rows: Any) -> int:
    """How many rows of the data (conversations, pairs) training rows come from."""
    return len(set(rows["source"]))


def hold_out_sources(split: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """``fraction`` of the data's rows (conversations), drawn with ``seed``, as the evaluation split, all the
    training rows made from a held-out conversation with it (a conversation learnt turn by turn is never in
    both); the same draw as ``causal_lm.documents.hold_out`` where each conversation is one row."""
    import numpy as np

    source = split.data["source"]
    unique = sorted(set(source))
    if len(unique) < 2:
        raise ConfigError(f"{split.origin} has {len(unique)} conversation, too few to hold out an evaluation set; "
                          "give task.data_files.validation.")
    order = np.random.RandomState(seed).permutation(len(unique))
    held = {unique[i] for i in order[:math.ceil(fraction * len(unique))]}
    tag = f"held-out-{fraction}-{seed}"
    train = [i for i, s in enumerate(source) if s not in held]
    evaluation = [i for i, s in enumerate(source) if s in held]
    return (Split(split.data.select(train), digest(split.fingerprint, tag, "train"), split.origin),
            Split(split.data.select(evaluation), digest(split.fingerprint, tag, "eval"), f"{split.origin} (held out)"))
