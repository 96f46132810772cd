"""The training state in a checkpoint folder (``Accelerator.save_state`` / ``load_state``), given the
objects explicitly: the Accelerator hands over what it prepared and registered (:class:`TrainingObjects`)
and gets its counters back.

A checkpoint folder holds (names as Accelerate's, ``_<i>`` for the i-th object of a kind after the
first; see ``store`` for the folder's life-cycle and ``format`` for the files):

- ``model.safetensors``: the full weights (the backend's ``checkpoint_io`` may write shards instead);
- ``optimizer.safetensors``: optimizer tensors, with the rest of its state as JSON in the header;
- ``scheduler.json``, ``scaler.json`` (fp16 only), ``dataloader.json`` (epoch, seed, samples
  consumed in the epoch; a loader whose position is each process's own, a stream's, writes
  ``dataloader_process_<rank>.json`` on every rank instead, and resumes only on as many processes),
  ``custom_checkpoint_<i>.json|.safetensors`` (``register_for_checkpointing``);
- ``rng_state_<rank>.safetensors``: python, numpy, torch (and the device's) RNG states of every rank
  (``rng``);
- ``accelerator_state.json``: the Accelerator's counters; and ``manifest.json``, written last.

Every rank calls save_state and load_state (they contain collectives). The main process verifies
a checkpoint before loading and tells the others the outcome, so all ranks fail alike.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from app.distributed.checkpoint import store
from app.distributed.checkpoint.errors import DISK_FULL_ERRNOS, CheckpointError
from app.distributed.checkpoint.format import WrittenFile, finish, write_state
from app.distributed.checkpoint.rng import capture_rng, restore_rng
from app.distributed.checkpoint.store import Manifest, load_into, read_state, state_file

if TYPE_CHECKING:
    from app.distributed.backend import Backend
    from app.distributed.precision import Precision
    from app.distributed.wrappers import AcceleratedOptimizer

log = logging.getLogger(__name__)

_MANIFEST_FIELDS = ("step", "epoch", "config_hash", "metric")


@dataclass
class Counters:
    """The Accelerator's own part of a checkpoint (``accelerator_state.json``)."""

    step: int
    micro_step: int
    seed: int | None


@dataclass
class TrainingObjects:
    """What a checkpoint holds, in the order the Accelerator prepared (or registered) them. Anything
    but the models and optimizers only needs ``state_dict``/``load_state_dict``."""

    models: Sequence[nn.Module]
    optimizers: Sequence[AcceleratedOptimizer]
    schedulers: Sequence[Any]
    dataloaders: Sequence[Any]
    custom_objects: Sequence[Any]
    precision: Precision
    counters: Counters


def _name(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}_{index}"


def _per_process(loader: Any) -> bool:
    """A loader whose position differs between processes (``StreamLoaderShard``): each rank saves its own."""
    return bool(getattr(loader, "per_process_state", False))


def _loader_file(index: int, rank: int) -> str:
    return f"{_name('dataloader', index)}_process_{rank}"


# -- save ------------------------------------------------------------------------------------------


def save_state(backend: Backend, objects: TrainingObjects, output_dir: str | os.PathLike[str] | None,
               project_dir: Path | None, total_limit: int | None, metadata: dict[str, Any] | None = None) -> Path:
    """Write the whole training state atomically; returns the checkpoint folder.

    Without ``output_dir`` the folder is ``<project_dir>/checkpoints/checkpoint_<N>``, N continuing
    from the manifests already there, and only the ``total_limit`` newest project checkpoints stay.
    ``metadata`` keys step, epoch, config_hash and metric go to the manifest's fields, any other key
    to its ``extra``.
    """
    main = backend.process_index == 0
    if output_dir is None and project_dir is None:
        raise ValueError("save_state() needs an output_dir, or an Accelerator built with project_dir.")
    plan: tuple[str, str, int] | None = None
    if main:
        if output_dir is None:
            assert project_dir is not None
            root = project_dir / store.CHECKPOINTS
            number = store.next_save_number(root)
            final = root / f"checkpoint_{number}"
        else:
            final = Path(output_dir)
            root = final.parent
            number = store.next_save_number(root)
        store.clean_temporaries(root)
        try:
            plan = (str(store.temporary_folder(root, number)), str(final), number)
        except OSError as err:
            if err.errno not in DISK_FULL_ERRNOS:
                raise
            raise store.disk_full(root, None, f"checkpoint_{number}") from None
    temporary_name, final_name, number = backend.broadcast_object(plan, src=0)
    temporary, final = Path(temporary_name), Path(final_name)
    try:
        saved = _write_checkpoint(backend, objects, temporary, final, number, metadata)
    except OSError as err:
        if err.errno not in DISK_FULL_ERRNOS:
            raise
        # A partial checkpoint is never chosen (it has no manifest); remove it now, not at the next save.
        raise store.disk_full(final.parent, temporary if main else None, final.name) from None
    if output_dir is None and total_limit is not None:  # the same on every rank
        # ProjectConfiguration(total_limit=N), as in Accelerate: only the N newest project checkpoints
        # stay, removed once the new one is complete (never the one just written); nobody moves on
        # (to load one) while the main process rotates.
        if main:
            store.rotate(saved.parent, total_limit, keep_best=False, newest=saved)
        backend.barrier()
    return saved


def _write_checkpoint(backend: Backend, objects: TrainingObjects, temporary: Path, final: Path, number: int,
                      metadata: dict[str, Any] | None) -> Path:
    main = backend.process_index == 0
    io = backend.checkpoint_io
    written: dict[str, WrittenFile | Path] = {}
    for i, model in enumerate(objects.models):
        written.update(io.save_model(model, temporary, _name("model", i)))
    if main:
        store.fault_point("files", number, temporary)
    for i, optimizer in enumerate(objects.optimizers):
        written.update(io.save_optimizer(_owner(objects, optimizer), optimizer.optimizer, temporary,
                                         _name("optimizer", i)))
    written.update(write_state(temporary, f"rng_state_{backend.process_index}", capture_rng(backend)))
    for i, loader in enumerate(objects.dataloaders):
        if _per_process(loader):
            written.update(write_state(temporary, _loader_file(i, backend.process_index), loader.state_dict()))
    if main:
        for i, scheduler in enumerate(objects.schedulers):
            written.update(write_state(temporary, _name("scheduler", i), scheduler.state_dict()))
        if precision_state := objects.precision.state_dict():
            written.update(write_state(temporary, "scaler", precision_state))
        for i, loader in enumerate(objects.dataloaders):
            if not _per_process(loader):
                written.update(write_state(temporary, _name("dataloader", i), loader.state_dict()))
        for i, obj in enumerate(objects.custom_objects):
            written.update(write_state(temporary, f"custom_checkpoint_{i}", obj.state_dict()))
        counters = objects.counters
        written.update(write_state(temporary, "accelerator_state",
                                   {"step": counters.step, "micro_step": counters.micro_step, "seed": counters.seed}))

    # Durable before the manifest names them; hashed from memory while the disk flushes.
    digests = finish(written)
    every_rank = backend.all_gather_object({k: (v.sha256, v.size) for k, v in digests.items()})
    if main:
        fields = {k: v for k, v in (metadata or {}).items() if k in _MANIFEST_FIELDS}
        extra = {k: v for k, v in (metadata or {}).items() if k not in _MANIFEST_FIELDS}
        files = {name: {"sha256": sha, "size": size} for part in every_rank for name, (sha, size) in part.items()}
        manifest = Manifest(save_number=number, world_size=backend.num_processes, files=dict(sorted(files.items())),
                            extra=extra, **fields)
        store.commit(temporary, final, manifest)
        log.info("saved checkpoint %s (step %s)", final, manifest.step)
    # Nobody moves on (to rotate, or to read it) before the checkpoint is in place.
    backend.barrier()
    return final


def _owner(objects: TrainingObjects, optimizer: AcceleratedOptimizer) -> nn.Module | None:
    """The prepared model whose parameters this optimizer updates (FSDP2 needs it to name states)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in objects.models:
        if any(id(p) in params for p in model.parameters()):
            return model
    return None


# -- load ------------------------------------------------------------------------------------------


def load_state(backend: Backend, objects: TrainingObjects, input_dir: str | os.PathLike[str] | None,
               project_dir: Path | None, config_hash: str | None = None) -> tuple[Manifest, Counters]:
    """Restore what :func:`save_state` wrote, RNG states last; returns the checkpoint's manifest and
    the counters it recorded (``objects.counters`` is left alone: the Accelerator sets its own).

    ``input_dir`` may be a checkpoint, a ``checkpoints/`` folder or a run folder (the newest
    checkpoint that verifies is used); without it, the project's ``checkpoints/``. With
    ``config_hash``, a checkpoint recording another one is refused before anything is loaded.
    Raises CheckpointError (one sentence) on every rank when there is no usable checkpoint.
    """
    main = backend.process_index == 0
    outcome: tuple[str, str] | None = None
    if main:
        try:
            if input_dir is None:
                if project_dir is None:
                    raise CheckpointError("load_state() needs an input_dir, or an Accelerator built with project_dir.")
                input_dir = project_dir / store.CHECKPOINTS
            chosen = store.find_checkpoint(Path(input_dir))
            recorded = store.read_manifest(chosen).config_hash  # type: ignore[union-attr]
            if config_hash is not None and recorded is not None and recorded != config_hash:
                raise CheckpointError(
                    f"{chosen} was saved by a run with another task or optimizer configuration (config hash "
                    f"{recorded}, this run {config_hash}); resume with the task and optim settings it was "
                    "trained with.")
            outcome = ("ok", str(chosen))
        except CheckpointError as err:
            outcome = ("error", str(err))
    status, detail = backend.broadcast_object(outcome, src=0)
    if status == "error":
        raise CheckpointError(detail)
    folder = Path(detail)
    manifest = store.read_manifest(folder)
    assert manifest is not None  # verified above
    if main and (unlisted := store.unlisted_files(folder)):
        log.warning("ignoring %s in %s: the manifest does not list them (only listed files are loaded)",
                    ", ".join(unlisted), folder)

    if any(_per_process(loader) for loader in objects.dataloaders) and manifest.world_size != backend.num_processes:
        raise CheckpointError(
            f"{folder} was saved by {manifest.world_size} process(es), each at its own position in its part of "
            f"the streamed training data, so it resumes on {manifest.world_size} process(es) only, not "
            f"{backend.num_processes}.")
    io = backend.checkpoint_io
    for i, model in enumerate(objects.models):
        io.load_model(model, folder, _name("model", i))
    for i, optimizer in enumerate(objects.optimizers):
        io.load_optimizer(_owner(objects, optimizer), optimizer.optimizer, folder, _name("optimizer", i))
    for i, scheduler in enumerate(objects.schedulers):
        load_into(scheduler, folder, _name("scheduler", i))
    if state_file(folder, "scaler") is not None:
        objects.precision.load_state_dict(read_state(folder, "scaler"))
    for i, loader in enumerate(objects.dataloaders):
        load_into(loader, folder, _loader_file(i, backend.process_index) if _per_process(loader)
                  else _name("dataloader", i))
    for i, obj in enumerate(objects.custom_objects):
        load_into(obj, folder, f"custom_checkpoint_{i}")
    saved = read_state(folder, "accelerator_state")
    counters = Counters(step=int(saved["step"]), micro_step=int(saved["micro_step"]),
                        seed=int(saved["seed"]) if saved.get("seed") is not None else objects.counters.seed)
    restore_rng(folder, backend, manifest)
    log.info("resumed from %s (step %s, epoch %s)", folder, manifest.step, manifest.epoch)
    return manifest, counters
