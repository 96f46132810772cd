"""The weights of a run's best evaluation, kept beside its checkpoints: ``checkpoints/best_<step>/``.

The engine keeps them whenever an evaluation improves on the best and no checkpoint of its step holds
them (``app/engine/checkpoint.py``), so that ``checkpoint.export=best`` exports that evaluation
whatever the checkpoint schedule. A folder is ``Accelerator.save_weights``'s: the evaluated weights
alone (``model.safetensors``, or FSDP2's per-rank shards in ``model/``), committed as a checkpoint
is (files fsynced, ``manifest.json`` last, renamed into place), the manifest recording the
evaluation's step, epoch and metric. Its name is no ``checkpoint_<N>``: it is never listed, chosen
for a resume or rotated as a checkpoint; :func:`prune` removes those no longer needed, once a newer
save is complete.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

from app.distributed.checkpoint import store
from app.distributed.checkpoint.store import Manifest, read_manifest
from app.distributed.checkpoint.training_state import holds_weights_only

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
