"""The weights of a run's best evaluation, kept beside its checkpoints: ``checkpoints/best_<step>/``.

The engine keeps them whenever an evaluation improves on the best and no checkpoint of its step holds
them (``app/engine/checkpoint.py``), so that ``checkpoint.export=best`` exports that evaluation
whatever the checkpoint schedule. A folder is ``Accelerator.save_weights``'s: the evaluated weights
alone (``model.safetensors``, or FSDP2's per-rank shards in ``model/``), committed as a checkpoint
is (files fsynced, ``manifest.json`` last, renamed into place), the manifest recording the
evaluation's step, epoch and metric. Its name is no ``checkpoint_<N>``: it is never listed, chosen
for a resume or rotated as a checkpoint; :func:`prune` removes those no longer needed, once a newer
save is complete. A checkpoint that rotation removes while its weights are still needed leaves them
here first (:func:`from_checkpoint`: its model's files, linked, under a weights-only manifest), so
``checkpoint.total_limit`` bounds the resumable checkpoints alone.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Collection
from pathlib import Path

from app.distributed.checkpoint import store
from app.distributed.checkpoint.atomic import fsync_paths
from app.distributed.checkpoint.store import Manifest, read_manifest
from app.distributed.checkpoint.training_state import HOLDS, WEIGHTS, holds_weights_only

_NAME = re.compile(r"best_(\d+)")


def folder(root: Path, step: int) -> Path:
    """Where the best evaluation at optimizer step ``step`` keeps its weights."""
    return root / f"best_{step}"


def kept(root: Path) -> list[tuple[Path, Manifest]]:
    """The committed ``best_<step>`` folders of ``root`` (their manifest parses, holds weights and names
    that step), by step."""
    found = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        manifest = read_manifest(entry)
        if manifest is not None and holds_weights_only(manifest) and manifest.step == int(match.group(1)):
            found.append((entry, manifest))
    return sorted(found, key=lambda item: item[1].step)


def find(root: Path, step: int, metric: str, value: float) -> tuple[Path, Manifest] | None:
    """The kept weights of the evaluation at ``step`` that measured ``metric`` = ``value`` (a folder left
    by another segment of the run, at that step but of another evaluation, is not it)."""
    for path, manifest in kept(root):
        if manifest.step == step and (manifest.metric or {}).get("name") == metric and manifest.metric_value() == value:
            return path, manifest
    return None


def prune(root: Path, needed_steps: Collection[int]) -> list[Path]:
    """Delete the kept weights of every step not in ``needed_steps`` (renamed first, as rotation
    does); returns what was deleted."""
    removed = []
    for path, manifest in kept(root):
        if manifest.step not in needed_steps:
            store.remove(root, path)
            removed.append(path)
    return removed


MODEL = "model"
"""The name a checkpoint's (first) model is saved under: ``model.safetensors``, or FSDP2's ``model/`` shards."""


def from_checkpoint(root: Path, checkpoint: Path, manifest: Manifest) -> Path:
    """``checkpoints/best_<step>`` holding the weights of ``checkpoint`` (its model's files, hard-linked
    where the file system allows, else copied), committed under a weights-only manifest with the
    checkpoint's step, epoch, config hash and metric: what :func:`find` and the export read. The
    checkpoint itself is left for the caller to remove. Main process."""
    target = folder(root, manifest.step)
    if (existing := read_manifest(target)) is not None and holds_weights_only(existing):
        return target  # kept already (written at its evaluation)
    files = {name: entry for name, entry in manifest.files.items()
             if name == f"{MODEL}.safetensors" or name.startswith(f"{MODEL}/")}
    temporary = store.temporary_folder(root, target.name)
    copied = []
    for name in files:
        destination = temporary / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(checkpoint / name, destination)
        except OSError:
            shutil.copy2(checkpoint / name, destination)
            copied.append(destination)
    fsync_paths(copied)
    kept_manifest = Manifest(save_number=manifest.step, step=manifest.step, epoch=manifest.epoch,
                             world_size=manifest.world_size, config_hash=manifest.config_hash, metric=manifest.metric,
                             files=dict(sorted(files.items())), extra={HOLDS: WEIGHTS})
    return store.commit(temporary, target, kept_manifest, label=target.name)
