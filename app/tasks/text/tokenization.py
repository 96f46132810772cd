"""Tokenization of a text task's splits, cached on disk.

The cache key is made of everything that changes the token ids and targets (tokenizer contents,
max_length, padding mode, the source data's contents, the columns read and the label encoding), so
a different tokenizer, max_length or label set never reuses a stale cache, and the other processes
of a distributed run read what the main process wrote.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from app.tasks.text.labels import LABEL_COLUMN

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""What single-label rows without gold label carry as ``labels``: cross-entropy skips them instead of
failing on -1."""
CACHE_VERSION = 2
"""Part of the cache key: bump it when ``_encode`` changes what it produces."""


def cache_root(cache_dir: str | None, task_name: str) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / f"app_text_{task_name}"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Digest of what makes the tokenizer produce its ids: vocabulary, normalizer, templates, sides.

    ``name_or_path`` alone is not enough: a local folder can be overwritten with another vocabulary.
    The backend's truncation/padding state is left out: it changes whenever the tokenizer is called,
    and our calls set both explicitly.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:  # a slow (pure Python) tokenizer: its vocabulary is what varies
        spec = sorted(tokenizer.get_vocab().items())
    identity = {
        "class": type(tokenizer).__name__,
        "name_or_path": str(tokenizer.name_or_path),
        "len": len(tokenizer),
        "model_input_names": list(tokenizer.model_input_names),
        "sides": [tokenizer.padding_side, tokenizer.truncation_side],
        "spec": spec,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def cache_key(tokenizer: PreTrainedTokenizerBase, max_length: int, pad_to_max_length: bool, data: str) -> str:
    payload = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "pad_to_max_length": pad_to_max_length,
        "data": data,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def tokenize_split(
    data: datasets.Dataset,
    data_key: str,
    name: str,
    text_columns: tuple[str, ...],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    pad_to_max_length: bool,
    cache_dir: Path,
    title: str,
    swap: bool = False,
) -> datasets.Dataset:
    """The text columns -> input_ids, attention_mask, (token_type_ids); the encoded targets
    (``LABEL_COLUMN``) -> labels; cached on disk. ``data_key`` digests the rows (their source and
    label encoding); ``swap`` encodes each pair in the other order (the second text first).

    The cache file's name is the key, and the key is passed as the new fingerprint: datasets'
    own fingerprint would hash the tokenizer object with dill, which is slow and not stable.
    """
    key = cache_key(tokenizer, max_length, pad_to_max_length, data_key + ("-swapped" if swap else ""))
    cache_dir.mkdir(parents=True, exist_ok=True)
    columns = text_columns[::-1] if swap else text_columns
    encode = functools.partial(_encode, tokenizer=tokenizer, columns=columns, max_length=max_length,
                               pad=pad_to_max_length)
    return data.map(
        encode,
        batched=True,
        remove_columns=data.column_names,
        new_fingerprint=key,
        cache_file_name=str(cache_dir / f"{name}-{key}.arrow"),
        load_from_cache_file=True,
        desc=f"Tokenizing {title} {name}",
    )


def _encode(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, columns: tuple[str, ...], max_length: int,
            pad: bool) -> dict:
    encoded = tokenizer(
        *(batch[c] for c in columns),
        truncation=True,  # a pair: longest_first, which trims the longer text of the pair first
        max_length=max_length,
        padding="max_length" if pad else False,
    )
    encoded = dict(encoded)
    # Class ids (-1: no gold label, skipped by cross-entropy as -100), numbers, or one 0/1 per class.
    encoded["labels"] = [IGNORE_INDEX if isinstance(label, int) and label < 0 else label
                         for label in batch[LABEL_COLUMN]]
    return encoded
