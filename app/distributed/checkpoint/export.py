"""Exported weights (``Accelerator.save_model`` and the run's final ``model/``): the full weights the
way transformers writes them, ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards
plus ``model.safetensors.index.json`` (``pytorch_model*.bin`` with ``safe_serialization=False``), so
that ``from_pretrained`` loads them.

:func:`export_shards` gathers the weights (every rank calls it: FSDP2 gathers them), :func:`write_weights`
writes them on the main process: file by file through ``atomic.publish`` into a folder that already
exists (``save_model``), or plainly into a temporary folder that its writer publishes whole (the
run's export, which adds the task's files).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from app.distributed.checkpoint.atomic import fsync_path, publish, temporary_sibling
from app.distributed.checkpoint.format import dedupe_shared, write_bytes, write_safetensors

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend

log = logging.getLogger(__name__)

_SIZE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def parse_size(size: int | str) -> int:
    """``"10GB"`` (powers of 1000, as transformers), ``"5MiB"`` (powers of 1024), or bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size must look like 10GB, 500MB or 5GiB, got {size!r}.")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"])


def tied_targets(model: nn.Module) -> set[str]:
    """Names a Transformers model re-ties when loading (so an export stores only their sources)."""
    mapping = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return set(mapping.keys()) if isinstance(mapping, dict) else set(mapping)


def shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def export_shards(backend: Backend, model: nn.Module, where: Path, max_shard_size: int | str = "10GB"
                  ) -> list[dict[str, torch.Tensor]]:
    """The model's full weights in files of at most ``max_shard_size``, with the unwrapped model's key
    names; tensors sharing memory are stored once. Every rank calls it; the main process gets the
    shards, the others ``[]``. ``where`` only names the destination in a warning."""
    max_bytes = parse_size(max_shard_size)
    state = backend.full_state_dict(model)
    if backend.process_index != 0:
        return []
    targets = tied_targets(backend.unwrap_model(model))
    unique, aliases = dedupe_shared(state, drop_first=targets)
    untied = sorted(a for a in aliases if a not in targets)
    if untied:
        log.warning("save_model stored tensors sharing memory once; %s will be missing from %s "
                    "(tie them again after loading).", untied, where)
    return shard(unique, max_bytes)


def save_model(backend: Backend, model: nn.Module, save_directory: str | os.PathLike[str],
               max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
    """``Accelerator.save_model``: every rank calls it, the main process writes into ``save_directory``
    (created if needed), each file published on its own; shards of an earlier save that this one does
    not use are removed."""
    folder = Path(save_directory)
    shards = export_shards(backend, model, folder, max_shard_size)
    if backend.process_index == 0:
        folder.mkdir(parents=True, exist_ok=True)
        write_weights(folder, shards, safe_serialization, each_file_atomic=True)
    backend.barrier()


def write_weights(folder: Path, shards: list[dict[str, torch.Tensor]], safe: bool, each_file_atomic: bool) -> None:
    """Write the shards (and their index when there are several) into ``folder``.

    ``each_file_atomic``: every file goes through ``atomic.publish`` (the folder is in use; the
    stale files of an earlier save are removed). Without it the files are written plainly: the
    folder is a temporary one that the caller fsyncs and publishes whole."""
    stem, suffix = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    names = ([f"{stem}.{suffix}"] if len(shards) == 1
             else [f"{stem}-{i:05d}-of-{len(shards):05d}.{suffix}" for i in range(1, len(shards) + 1)])
    index_name = f"{stem}.{suffix}.index.json"
    for name, tensors in zip(names, shards):
        _write(folder / name, functools.partial(_write_shard, tensors=tensors, safe=safe), each_file_atomic)
    stale = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.{suffix}")
    for old in folder.iterdir():
        if stale.fullmatch(old.name) and old.name not in names:
            old.unlink()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
                 "weight_map": {k: name for name, s in zip(names, shards) for k in s}}
        data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        _write(folder / index_name, lambda path: write_bytes(path, data), each_file_atomic)
    elif (folder / index_name).exists():
        (folder / index_name).unlink()
    if each_file_atomic:
        fsync_path(folder)


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], safe: bool) -> None:
    if safe:
        write_safetensors(path, tensors, {"format": "pt"})
    else:
        torch.save({k: v.contiguous() for k, v in tensors.items()}, path)


def _write(target: Path, write: Callable[[Path], object], atomic: bool) -> None:
    if not atomic:
        write(target)
        return
    temporary = temporary_sibling(target)
    write(temporary)
    fsync_path(temporary)
    publish(temporary, target)
