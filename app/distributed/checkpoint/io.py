"""How a backend reads and writes a checkpoint's model and optimizer state: :class:`CheckpointIO`.

A backend *has* one (``Backend.checkpoint_io``), chosen by how it lays out the state:

- :class:`FullStateIO` (one process, DDP, XLA): the main process writes the full state, every rank
  reads it whole into its replica;
- ``sharded_io.ShardedStateIO`` (FSDP2): every rank writes its own weight shards, the optimizer
  state is gathered to the main process; loading re-shards.

Both read either layout (``layouts``), so a checkpoint moves between backends and world sizes.
Every rank calls every method (some are collectives). The save methods *stage* the files this rank
writes (``staging``: by reference for a synchronous save, copied off the device for an asynchronous
one) and return them as ``staging.Pending``; the caller writes them (at once, or on its writer
thread), then fsyncs and hashes them for the manifest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from app.distributed.checkpoint.errors import CheckpointError
from app.distributed.checkpoint.format import dedupe_shared, stage_safetensors, stage_state
from app.distributed.checkpoint.layouts import (
    by_parameter_index,
    check_compatible,
    full_model_files,
    keep_implementation,
    read_full_model_state,
    read_sharded_model_state,
    saved_part,
    sharded_shapes,
)
from app.distributed.checkpoint.staging import Pending, Staging
from app.distributed.checkpoint.store import listed_files, lists_folder, load_into

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend


class CheckpointIO(Protocol):
    """Model and optimizer state in a checkpoint folder, as one backend lays it out."""

    def save_model(self, model: nn.Module, folder: Path, name: str, staging: Staging,
                   keep: Callable[[str], bool] | None = None) -> list[Pending]:
        """Stage the (prepared) model's weights as ``name`` in ``folder``; ``keep``: which state-dict
        names to save (None: all)."""
        ...

    def load_model(self, model: nn.Module, folder: Path, name: str, partial: bool = False) -> None:
        """Load weights ``name`` into the model, whichever layout wrote them; ``partial``: they may be
        some of the model's (those saved with a ``keep``), the others stay as they are."""
        ...

    def save_optimizer(self, model: nn.Module | None, optimizer: torch.optim.Optimizer, folder: Path,
                       name: str, staging: Staging) -> list[Pending]:
        """Stage the state of the optimizer that updates ``model``'s parameters (None: no prepared model)."""
        ...

    def load_optimizer(self, model: nn.Module | None, optimizer: torch.optim.Optimizer, folder: Path,
                       name: str) -> None:
        ...


class FullStateIO:
    """The full state, written by the main process (DDP replicates it on every rank); every rank
    reads it whole."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def save_model(self, model: nn.Module, folder: Path, name: str, staging: Staging,
                   keep: Callable[[str], bool] | None = None) -> list[Pending]:
        """``<name>.safetensors`` with the full weights (tied weights are stored once and recorded as aliases)."""
        state = self.backend.full_state_dict(model)
        if self.backend.process_index != 0:
            return []
        if keep is not None:
            state = {k: v for k, v in state.items() if keep(k)}
        unique, aliases = dedupe_shared(state)
        metadata = {"format": "pt", "aliases": json.dumps(aliases)}
        return [stage_safetensors(folder, f"{name}.safetensors", unique, metadata, staging)]

    def load_model(self, model: nn.Module, folder: Path, name: str, partial: bool = False) -> None:
        """Every rank reads the full weights into its (replicated) model, from ``<name>.safetensors``
        or from the shards an FSDP2 run wrote."""
        inner = self.backend.unwrap_model(model)
        path = folder / f"{name}.safetensors"
        listed = listed_files(folder)
        expected = inner.state_dict()
        if files := full_model_files(folder, name, listed):
            state = read_full_model_state(folder, files)
            check_compatible(saved_part(expected, state) if partial else expected, state, path)
        elif lists_folder(folder, name) if listed is not None else (folder / name).is_dir():
            shapes = sharded_shapes(folder / name)
            expected = saved_part(expected, shapes) if partial else expected
            check_compatible(expected, shapes, folder / name)
            state = read_sharded_model_state(folder / name, expected)
        else:
            raise CheckpointError(f"{folder} has no {path.name}, so it was saved with a different model setup.")
        inner.load_state_dict(state, strict=not partial)

    def save_optimizer(self, model: nn.Module | None, optimizer: torch.optim.Optimizer, folder: Path,
                       name: str, staging: Staging) -> list[Pending]:
        if self.backend.process_index != 0:
            return []
        return [stage_state(folder, name, optimizer.state_dict(), staging)]

    def load_optimizer(self, model: nn.Module | None, optimizer: torch.optim.Optimizer, folder: Path,
                       name: str) -> None:
        """Every rank loads the whole state (keyed by parameter name when an FSDP2 run saved it)."""
        inner = self.backend.unwrap_model(model) if model is not None else None
        load_into(optimizer, folder, name,
                  convert=lambda state: keep_implementation(by_parameter_index(state, inner, optimizer), optimizer))
