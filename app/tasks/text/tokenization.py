"""Tokenization of GLUE splits, cached on disk.

The cache key is made of everything that changes the token ids (tokenizer contents, max_length,
padding mode, the source data's contents), so a different tokenizer or max_length never reuses a
stale cache, and the other processes of a distributed run read what the main process wrote.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from app.tasks.glue.config import GlueConfig, GlueSpec
from app.tasks.glue.sources import Split

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""What rows without gold label carry as ``labels``: cross-entropy skips them instead of failing on -1."""
CACHE_VERSION = 1
"""Part of the cache key: bump it when ``_encode`` changes what it produces."""


def cache_root(cfg: GlueConfig, spec: GlueSpec) -> Path:
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir).expanduser()
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / f"app_glue_{spec.config}"


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
    split: Split,
    name: str,
    spec: GlueSpec,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    pad_to_max_length: bool,
    cache_dir: Path,
    swap: bool = False,
) -> datasets.Dataset:
    """The spec's text columns -> input_ids, attention_mask, (token_type_ids), labels; cached on disk.
    ``swap`` encodes each pair in the other order (the second sentence first).

    The cache file's name is the key, and the key is passed as the new fingerprint: datasets'
    own fingerprint would hash the tokenizer object with dill, which is slow and not stable.
    """
    key = cache_key(tokenizer, max_length, pad_to_max_length, split.fingerprint + ("-swapped" if swap else ""))
    cache_dir.mkdir(parents=True, exist_ok=True)
    columns = spec.text_columns[::-1] if swap else spec.text_columns
    encode = functools.partial(_encode, tokenizer=tokenizer, columns=columns, max_length=max_length,
                               pad=pad_to_max_length)
    return split.data.map(
        encode,
        batched=True,
        remove_columns=split.data.column_names,
        new_fingerprint=key,
        cache_file_name=str(cache_dir / f"{name}-{key}.arrow"),
        load_from_cache_file=True,
        desc=f"Tokenizing {spec.title} {name}",
    )


def _encode(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, columns: tuple[str, ...], max_length: int,
            pad: bool) -> dict:
    encoded = tokenizer(
        *(batch[c] for c in columns),
        truncation=True,  # a pair: longest_first, which trims the longer sentence of the pair first
        max_length=max_length,
        padding="max_length" if pad else False,
    )
    encoded = dict(encoded)
    encoded["labels"] = [label if label >= 0 else IGNORE_INDEX for label in batch["label"]]
    return encoded
