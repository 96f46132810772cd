"""From rows to training rows: each row formatted (``spans.SpanFinder``), tokenized once with character
offsets, and labelled: a token is learnt (its label is its id) where it overlaps a learnt range, else
its label is -100. A split is tokenized by ``datasets.map`` (``task.num_proc`` processes, a progress
bar, cached on disk under a key of everything that changes the rows), then the rows with nothing
learnt are dropped and counted."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.config import ConfigError
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.sft.config import DataFormat, Overlong, SFTConfig, TrainOn
from app.tasks.sft.conversations import BadRow, Fields, read_row
from app.tasks.sft.spans import Formatted, Ranges, SpanFinder, UnusableTemplate
from app.tasks.text.sources import Split
from app.tasks.text.tokenization import tokenizer_fingerprint

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

CACHE_VERSION = 1
"""Part of the cache key: bump it when ``encode_rows`` changes what it produces."""


@dataclass(frozen=True)
class Recipe:
    """Everything besides the tokenizer and the data that decides a split's rows (picklable for the
    tokenizing processes, and the cache key)."""

    data_format: DataFormat
    fields: Fields
    train_on: TrainOn
    block_size: int
    overlong: Overlong
    origin: str
    """The split's file, for messages."""
    lines: bool
    """Rows are the lines of a JSON Lines file: messages say "line N" (else "row N")."""

    @classmethod
    def of(cls, cfg: SFTConfig, data_format: DataFormat, split: Split) -> Recipe:
        return cls(data_format, Fields.of(cfg), cfg.train_on, cfg.block_size, cfg.overlong, split.origin,
                   split.origin.lower().endswith(".jsonl"))

    def where(self, index: int) -> str:
        return f"{self.origin} {'line' if self.lines else 'row'} {index + 1}"


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


def encode_rows(batch: dict[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase,
                recipe: Recipe) -> dict[str, list]:
    """A ``datasets.map`` batch -> ``input_ids``, ``labels``, ``learnt`` (tokens learnt, 0: dropped later),
    ``cut`` (1: truncated to block_size) and ``error``: why a bad row is refused, naming its line (empty
    for a good row). Errors are returned, not raised: raised in one of ``task.num_proc`` processes, the
    pool would be torn down mid-work; :func:`first_error` raises the first one in the main process."""
    finder = SpanFinder(tokenizer, recipe.train_on)
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    formatted: list[Formatted | None] = []
    errors = []
    for index, row in zip(indices, rows, strict=True):
        try:
            formatted.append(finder(read_row(row, recipe.data_format, recipe.fields)))
            errors.append("")
        except BadRow as err:
            formatted.append(None)
            errors.append(f"{recipe.where(index)}: {err}.")
        except UnusableTemplate as err:
            formatted.append(None)
            errors.append(f"The chat template cannot be trained on with task.train_on={recipe.train_on.value}: {err} "
                          f"({recipe.where(index)}); give task.chat_template=chatml or a Jinja file.")
    encoded = iter(tokenize(tokenizer, [f for f in formatted if f is not None]))
    out: dict[str, list] = {"input_ids": [], "labels": [], "learnt": [], "cut": [], "error": errors}
    for i, (index, item) in enumerate(zip(indices, formatted, strict=True)):
        ids, labels = next(encoded) if item is not None else ([], [])
        cut = len(ids) > recipe.block_size
        if cut and recipe.overlong is Overlong.refuse:
            errors[i] = (f"{recipe.where(index)} is {len(ids)} tokens long, more than task.block_size="
                         f"{recipe.block_size} (task.overlong=refuse); give a larger block_size or "
                         "task.overlong=truncate or drop.")
        if cut:
            ids, labels = ids[:recipe.block_size], labels[:recipe.block_size]
        learnt = 0 if cut and recipe.overlong is Overlong.drop else len(labels) - labels.count(IGNORE_INDEX)
        for key, value in (("input_ids", ids), ("labels", labels), ("learnt", learnt), ("cut", int(cut))):
            out[key].append(value)
    return out


def row_features() -> datasets.Features:
    """The columns of :func:`encode_rows`, given to ``datasets.map`` so it need not infer them batch by batch
    (a scan of every value); the types it infers (``input_ids`` narrowed to int32, as datasets does)."""
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value("int32")), "labels": List(Value("int64")), "learnt": Value("int64"),
                     "cut": Value("int64"), "error": Value("string")})


def first_error(out: dict[str, list] | datasets.Dataset) -> None:
    """Raise the first row's refusal (a ConfigError), if any row was refused."""
    error = next((e for e in out["error"] if e), None)
    if error is not None:
        raise ConfigError(error)


def tokenize_split(split: Split, name: str, tokenizer: PreTrainedTokenizerBase, cfg: SFTConfig,
                   data_format: DataFormat, cache_dir: Path | None) -> tuple[datasets.Dataset, int, int]:
    """The split's rows with something learnt, and how many were dropped (nothing learnt) and cut."""
    recipe = Recipe.of(cfg, data_format, split)
    payload = {"version": CACHE_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer),
               "template": tokenizer.chat_template, "recipe": {**asdict(recipe), "origin": None},
               "data": split.fingerprint}
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
    first_error(rows)
    learnt = rows["learnt"]
    kept = [i for i, n in enumerate(learnt) if n > 0]
    cut = sum(rows["cut"])
    if len(kept) < len(rows):
        rows = rows.select(kept)
    return rows, len(learnt) - len(kept), cut
