"""From documents to training rows: tokenization with an EOS after each document, packing into blocks
(the Transformers examples' ``group_texts``), and the map-style splits tokenized once and cached.

The same two functions, :func:`encode_documents` and :func:`pack`, serve the cached splits here and
the stream (``stream.py``), which packs on the fly and carries the unfinished block from one read
to the next.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.config import ConfigError
from app.tasks.causal_lm.config import CausalLMConfig
from app.tasks.text.sources import FILE_FORMATS, Split, load_dataset_splits, read_file
from app.tasks.text.task import digest
from app.tasks.text.tokenization import tokenizer_fingerprint

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

LM_FORMATS: dict[str, tuple[str, dict[str, str]]] = {".txt": ("text", {}), ".text": ("text", {}), **FILE_FORMATS}
"""The text task's formats and plain text (``datasets``' text builder: one row per line, column ``text``)."""
CACHE_VERSION = 1
"""Part of the cache key: bump it when ``encode_rows`` changes what it produces."""


def encode_documents(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each document that has text (blank ones are no document), with the tokenizer's own
    special tokens (Llama's BOS first) and its EOS after it: the boundary packed blocks keep."""
    kept = [t for t in texts if t and not t.isspace()]
    if not kept:
        return []
    eos = tokenizer.eos_token_id
    # verbose=False: a document longer than the model's context is expected here (it is cut into blocks).
    encoded = tokenizer(kept, verbose=False, return_attention_mask=False)["input_ids"]
    if eos is None:
        return encoded
    return [ids if ids and ids[-1] == eos else [*ids, eos] for ids in encoded]


def pack(carry: list[int], documents: list[list[int]], block_size: int) -> tuple[list[list[int]], list[int]]:
    """``carry`` then the documents, concatenated and cut into blocks of ``block_size`` tokens; returns
    the blocks and what is left over (shorter than a block)."""
    tokens = [*carry, *(t for ids in documents for t in ids)]
    whole = len(tokens) // block_size * block_size
    return [tokens[i:i + block_size] for i in range(0, whole, block_size)], tokens[whole:]


def encode_rows(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, field: str, block_size: int,
                packing: bool) -> dict[str, list[list[int]]]:
    """A ``datasets.map`` batch of documents -> ``input_ids`` rows: packed blocks (the tail shorter than a
    block is dropped, per batch of 1,000 documents, as the Transformers examples do), or one row per
    document cut to ``block_size`` tokens."""
    documents = encode_documents(tokenizer, batch[field])
    if packing:
        return {"input_ids": pack([], documents, block_size)[0]}
    return {"input_ids": [ids[:block_size] for ids in documents]}


# -- map-style splits ------------------------------------------------------------------------------------


def load_documents(cfg: CausalLMConfig, raw_cache: Path,
                   names: tuple[str, ...] = ("train", "validation")) -> dict[str, Split]:
    """The splits of ``names`` the source has: local files (``task.data_files``) or
    ``datasets.load_dataset(task.dataset, task.dataset_config)``."""
    if cfg.data_files.train is not None:
        files = {"train": cfg.data_files.train, "validation": cfg.data_files.validation}
        splits = {split: read_file(path, split, raw_cache, LM_FORMATS) for split, path in files.items()
                  if path is not None and split in names}
    else:
        assert cfg.dataset is not None  # the schema's check: one of the two is given
        splits = load_dataset_splits(cfg.dataset, cfg.dataset_config, None, list(names))
    for split in splits.values():
        check_text_field(split, cfg.text_field)
    return splits


def check_text_field(split: Split, field: str) -> None:
    columns = split.data.column_names
    if field not in columns:
        raise ConfigError(f"{split.origin} has no {field!r} column (it has {', '.join(columns)}); set task.text_field "
                          "to the one holding the text.")


def hold_out(split: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """``fraction`` of the documents, drawn with ``seed``, as the evaluation split; the rest to train on."""
    import numpy as np

    n = len(split.data)
    if n < 2:
        raise ConfigError(f"{split.origin} has {n} document, too few to hold out an evaluation set; give "
                          "task.data_files.validation.")
    order = np.random.RandomState(seed).permutation(n)
    cut = math.ceil(fraction * n)
    tag = f"held-out-{fraction}-{seed}"
    return (Split(split.data.select(sorted(order[cut:])), digest(split.fingerprint, tag, "train"), split.origin),
            Split(split.data.select(sorted(order[:cut])), digest(split.fingerprint, tag, "eval"),
                  f"{split.origin} (held out)"))


def tokenize_split(split: Split, name: str, tokenizer: PreTrainedTokenizerBase, cfg: CausalLMConfig,
                   cache_dir: Path | None, title: str) -> datasets.Dataset:
    """A split's documents -> ``input_ids`` rows (:func:`encode_rows`), cached on disk under a key of
    everything that changes them: tokenizer, block size, packing, the text column and the data. No
    cache folder: computed in memory (the few held-out documents of a stream)."""
    payload = {"version": CACHE_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer), "block_size": cfg.block_size,
               "packing": cfg.packing, "field": cfg.text_field, "data": split.fingerprint}
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]
    encode = functools.partial(encode_rows, tokenizer=tokenizer, field=cfg.text_field, block_size=cfg.block_size,
                               packing=cfg.packing)
    cached: dict[str, Any] = {}
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cached = {"cache_file_name": str(cache_dir / f"lm-{name}-{key}.arrow"), "load_from_cache_file": True}
    return split.data.map(encode, batched=True, remove_columns=split.data.column_names, new_fingerprint=key,
                          desc=f"Tokenizing {title} {name}", **cached)
