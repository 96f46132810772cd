"""The Accelerator's saving and loading: the whole training state (``save_state``/``load_state``, with
their pre-hooks and registered objects), weights alone (``save_weights``/``load_weights``), exported
models (``save_model``/``load_model``) and single objects (``save``), on ``app/distributed/checkpoint/``."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from app.distributed.checkpoint.export import export_shards, save_model
from app.distributed.checkpoint.training_state import (
    Counters,
    TrainingObjects,
    load_state,
    load_weights,
    save_state,
    save_weights,
)
from app.distributed.facade.fields import AcceleratorFields
from app.run_folder.layout import checkpoints_dir


class Saving(AcceleratorFields):
    """``Accelerator``'s saving and loading (a mixin)."""

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on CPU (gathered from shards under FSDP2; valid on the main process),
        with the unwrapped model's key names."""
        if not unwrap:
            raise ValueError("get_state_dict(unwrap=False) is not supported: it returns the unwrapped model's full "
                             "weights; call model.state_dict() for the wrapper's own keys.")
        return self.backend.full_state_dict(model)


    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with state_dict/load_state_dict) with the state."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"{type(obj).__name__} has no state_dict/load_state_dict, so it cannot be checkpointed.")
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                   *, metadata: dict[str, Any] | None = None, async_save: bool = False,
                   on_complete: Callable[[Path], None] | None = None) -> Path:
        """Save models, optimizers, schedulers, scaler, dataloader positions, RNG states of every
        rank and registered objects, atomically (see ``app/distributed/checkpoint/``); every
        process must call it. Returns the checkpoint folder.

        Without ``output_dir``: ``<project_dir>/checkpoints/checkpoint_<N>``, N continuing from the
        checkpoints already there. ``metadata`` (step, epoch, config_hash, metric, anything else)
        is recorded in the folder's ``manifest.json``. ``on_complete(folder)`` runs on the main process
        once the checkpoint is complete (and ``total_limit`` rotated), before the save counts as done.

        ``async_save=True``: the state is copied off the device (into host buffers kept for the next
        save: one more copy of the state in host memory) and the call returns; the files are written,
        fsynced and committed on a writer thread while training goes on. The folder exists once
        :meth:`wait_for_checkpoint` returns; the next save, ``load_state`` and ``end_training`` wait
        for it too, and raise its error. Synchronous anyway where that copy would not fit in half the
        available host memory (said once), or on several XLA hosts.

        >>> accelerator = Accelerator(project_dir="runs/exp1")
        >>> accelerator.save_state()                  # runs/exp1/checkpoints/checkpoint_0
        >>> accelerator.save_state(async_save=True)   # checkpoint_1, written while training goes on
        >>> accelerator.wait_for_checkpoint()         # ... complete now
        >>> accelerator.load_state()                  # the newest checkpoint that verifies
        """
        if not safe_serialization:
            raise ValueError("save_state writes safetensors and JSON only (no pickle); safe_serialization=False "
                             "is not supported.")
        with self._models_kept_by(self._save_state_pre_hooks, output_dir, with_weights=True):
            return save_state(self.backend, self._training_objects(), output_dir, self.project_dir,
                              self.project_configuration.total_limit, metadata, writer=self._checkpoint_writer,
                              async_save=async_save, on_complete=on_complete)

    def save_weights(self, model: nn.Module, output_dir: str | os.PathLike[str], *, trainable_only: bool = False,
                     metadata: dict[str, Any] | None = None, async_save: bool = False,
                     on_complete: Callable[[Path], None] | None = None) -> Path:
        """Save ``model``'s weights alone into ``output_dir`` (replacing what is there), committed as a
        checkpoint is: written into a temporary folder, fsynced, listed with their SHA-256 in a
        ``manifest.json`` written last, renamed into place; on FSDP2 each rank writes its shards. No
        optimizer, data position or RNG state: a folder to load weights from (:meth:`load_weights`),
        not to resume training. ``trainable_only`` leaves frozen parameters out (a LoRA model's
        adapters and head are what changes). ``metadata`` (step, epoch, metric, ...) goes to the
        manifest; ``async_save`` and ``on_complete`` as in :meth:`save_state`, whose write in flight
        it waits for first. Every process calls it.

        >>> accelerator.save_weights(model, "runs/exp1/best", trainable_only=True, async_save=True)
        >>> accelerator.load_weights(model, "runs/exp1/best")   # waits for the write, verifies, loads
        """
        return save_weights(self.backend, model, Path(output_dir), self.project_dir, metadata,
                            trainable_only=trainable_only, writer=self._checkpoint_writer, async_save=async_save,
                            on_complete=on_complete)

    def load_weights(self, model: nn.Module, input_dir: str | os.PathLike[str]) -> Any:
        """Load the weights :meth:`save_weights` wrote into a prepared model (a parameter it left out
        keeps its value), once the folder verifies (manifest, sizes, SHA-256); returns its manifest.
        Raises ``CheckpointError`` (one sentence) on every process when it does not verify."""
        self.wait_for_checkpoint()
        return load_weights(self.backend, model, Path(input_dir))

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the checkpoint being written in the background (``save_state(async_save=True)``)
        is complete; returns its folder (None: none was being written). Its error, if the write failed,
        is raised here (``DiskFullError``, ``CheckpointWriteError``: one sentence; nothing of that save
        is committed). Every process calls it.

        >>> accelerator.wait_for_checkpoint()
        """
        return self._checkpoint_writer.wait()

    def _training_objects(self) -> TrainingObjects:
        """What save_state and load_state work on: everything prepared or registered, and the counters."""
        return TrainingObjects(models=list(self._models), optimizers=list(self._optimizers),
                               schedulers=list(self._schedulers), dataloaders=list(self._dataloaders),
                               custom_objects=list(self._custom_objects), precision=self.precision,
                               counters=Counters(self.step, self._micro_step, self._seed))

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs before ``save_state`` writes; a model it removes
        from ``models`` is not saved (``weights`` are their state dicts, to read). Returns a handle
        whose ``remove()`` unregisters it."""
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs before ``load_state`` reads; a model it removes from
        ``models`` is not loaded. Returns a handle whose ``remove()`` unregisters it."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle

    @contextlib.contextmanager
    def _models_kept_by(self, hooks: dict[int, Callable[..., None]], folder: Any, with_weights: bool) -> Iterator[None]:
        if not hooks:
            yield
            return
        models = list(self._models)
        where = str(folder if folder is not None else checkpoints_dir(self.project_dir or Path.cwd()))
        for hook in hooks.values():
            if with_weights:
                hook(models, [self.get_state_dict(m) for m in models], where)
            else:
                hook(models, where)
        everything, self._models = self._models, [m for m in self._models if any(m is k for k in models)]
        try:
            yield
        finally:
            self._models = everything

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Write ``obj`` from the main process: a dict of tensors as safetensors, anything JSON can
        hold as JSON. Nothing is pickled: other objects are refused.

        >>> accelerator.save(accelerator.get_state_dict(model), "weights.safetensors")
        """
        if not self.is_main_process:
            return
        if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in obj.items()}, str(f))
            return
        if safe_serialization:
            raise ValueError(f"Accelerator.save(safe_serialization=True) writes safetensors, which hold a dict of "
                             f"tensors; a {type(obj).__name__} is not one (leave safe_serialization off for JSON data).")
        try:
            text = json.dumps(obj)
        except TypeError as error:
            raise ValueError(f"Accelerator.save writes a dict of tensors (safetensors) or JSON data, never pickle; "
                             f"a {type(obj).__name__} is neither ({error}).") from None
        Path(f).write_text(text)


    def load_state(self, input_dir: str | os.PathLike[str] | None = None, *, config_hash: str | None = None) -> Any:
        """Restore what save_state wrote, RNG states last; returns the checkpoint's manifest.

        ``input_dir``: one checkpoint, a ``checkpoints/`` folder or a run folder (then the newest
        checkpoint whose files match their SHA-256 is used); default: the project's checkpoints.
        ``config_hash``: refuse a checkpoint whose manifest records another one. Raises
        ``CheckpointError`` (a ``ConfigError``) when no usable checkpoint is found.

        >>> accelerator.load_state("runs/exp1/checkpoints/checkpoint_3")
        """
        self.wait_for_checkpoint()
        with self._models_kept_by(self._load_state_pre_hooks, input_dir, with_weights=False):
            manifest, counters = load_state(self.backend, self._training_objects(), input_dir, self.project_dir,
                                            config_hash)
        self.step, self._micro_step, self._seed = counters.step, counters.micro_step, counters.seed
        return manifest

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Write the full weights as ``model.safetensors``, or as ``model-0000i-of-0000N.safetensors``
        shards with ``model.safetensors.index.json`` when larger than ``max_shard_size``; every process
        calls it, the main process writes.

        >>> accelerator.save_model(model, "export", max_shard_size="1GB")
        """
        save_model(self.backend, model, save_directory, max_shard_size, safe_serialization)

    def load_model(self, model: nn.Module, folder: str | os.PathLike[str]) -> None:
        """Load the weights of an exported model folder (``save_model``'s: ``model.safetensors``, or
        shards with ``model.safetensors.index.json``) into a prepared model; every process calls it.

        >>> accelerator.load_model(model, "export")
        """
        self.backend.checkpoint_io.load_model(model, Path(folder), "model")

    def model_shards(self, model: nn.Module, where: str | os.PathLike[str],
                     max_shard_size: int | str = "10GB") -> list[dict[str, torch.Tensor]]:
        """The full weights ``save_model`` writes, as files of at most ``max_shard_size`` (name ->
        tensor, the unwrapped model's names), for a caller that writes them itself; every process
        calls it (FSDP2 gathers), the main process gets the shards, the others ``[]``. ``where`` only
        names the destination in a warning."""
        return export_shards(self.backend, model, Path(where), max_shard_size)
