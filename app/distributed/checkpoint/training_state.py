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
a checkpoint before loading and tells the others the outcome, so all ranks fail alike; a save's ranks
agree on its outcome the same way. A save is staged on the main thread (the state as it is at the
call) and written either at once or, asynchronously, on the Accelerator's writer thread
(``background``), its state copied off the device first (``staging``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.distributed.checkpoint import store
from app.distributed.checkpoint.background import BackgroundWriter, WriterCollectives, fits_in_host_memory
from app.distributed.checkpoint.errors import (
    DISK_FULL_ERRNOS,
    CheckpointError,
    CheckpointWriteError,
    DiskFullError,
    first_line,
)
from app.distributed.checkpoint.format import WrittenFile, finish, stage_state
from app.distributed.checkpoint.rng import capture_rng, restore_rng
from app.distributed.checkpoint.staging import Pending, Staging
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
               project_dir: Path | None, total_limit: int | None, metadata: dict[str, Any] | None = None,
               writer: BackgroundWriter | None = None, async_save: bool = False,
               on_complete: Callable[[Path], None] | None = None) -> Path:
    """Write the whole training state atomically; returns the checkpoint folder.

    Without ``output_dir`` the folder is ``<project_dir>/checkpoints/checkpoint_<N>``, N continuing
    from the manifests already there, and only the ``total_limit`` newest project checkpoints stay.
    ``metadata`` keys step, epoch, config_hash and metric go to the manifest's fields, any other key
    to its ``extra``. ``on_complete(folder)`` runs on the main process once the checkpoint is complete
    and rotated, before any process goes on from the save.

    ``writer``: the Accelerator's :class:`BackgroundWriter`, whose write in flight is waited for first.
    With ``async_save`` the state is copied off the device and the write (files, fsync, manifest,
    rename, rotation, ``on_complete``) runs on the writer's thread: the returned folder exists once
    ``writer.wait()`` returns. A save is synchronous anyway where the backend has no collectives to
    spare for a writer thread, or where the copy would not fit in host memory (said in the log).
    """
    main = backend.process_index == 0
    if output_dir is None and project_dir is None:
        raise ValueError("save_state() needs an output_dir, or an Accelerator built with project_dir.")
    if writer is not None:
        writer.wait()
    collectives: WriterCollectives | None = backend
    if writer is not None and async_save:
        collectives = backend.background_collectives() if _copy_fits(writer, objects) else None
    else:
        writer = None
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
    in_background = writer is not None and collectives is not None
    staging = Staging(copy=in_background, pin_memory=backend.ops.pinned_memory,
                      buffers=writer.buffers if writer is not None else {},
                      process_group=getattr(collectives, "group", None) if in_background else None)
    try:
        pending, model_files = _stage(backend, objects, temporary, staging)
    except OSError as err:  # a library that writes while staging (FSDP2's synchronous shards)
        if err.errno not in DISK_FULL_ERRNOS:
            raise
        raise store.disk_full(final.parent, temporary if main else None, final.name) from None
    rotation = (total_limit if output_dir is None else None, on_complete, shown(final, project_dir))
    if not in_background:
        return _write_checkpoint(backend, backend, pending, model_files, temporary, final, number, metadata, rotation)
    assert writer is not None and collectives is not None
    writer.buffers = staging.used
    writer.start(lambda: _write_checkpoint(backend, collectives, pending, model_files, temporary, final, number,
                                           metadata, rotation))
    return final


def _copy_fits(writer: BackgroundWriter, objects: TrainingObjects) -> bool:
    """Whether an asynchronous save may copy the state: its buffers exist already (an earlier save
    made them), or one more copy leaves half of the available host memory free."""
    if writer.buffers:
        return True
    needed = sum(_tensor_bytes(model.state_dict()) for model in objects.models)
    needed += sum(_tensor_bytes(optimizer.optimizer.state_dict()["state"]) for optimizer in objects.optimizers)
    fits, available = fits_in_host_memory(needed)
    if not fits and not writer.said_too_large:
        writer.said_too_large = True
        log.warning("saving checkpoints synchronously: an asynchronous save copies the training state "
                    "(%.2f GB) to host memory, more than half of the %.2f GB available", needed / 1e9,
                    (available or 0) / 1e9)
    return fits


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        local = getattr(state, "_local_tensor", state)  # a DTensor: this rank's shard
        return int(local.numel() * local.element_size())
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _stage(backend: Backend, objects: TrainingObjects, temporary: Path, staging: Staging) -> tuple[list[Pending], int]:
    """This rank's files of the checkpoint, staged (on the main thread: the state as it is now), and how
    many of the first are the models' (the crash tests stop between those and the rest)."""
    main = backend.process_index == 0
    io = backend.checkpoint_io
    pending: list[Pending] = []
    for i, model in enumerate(objects.models):
        pending += io.save_model(model, temporary, _name("model", i), staging)
    model_files = len(pending)
    for i, optimizer in enumerate(objects.optimizers):
        pending += io.save_optimizer(_owner(objects, optimizer), optimizer.optimizer, temporary,
                                     _name("optimizer", i), staging)
    pending.append(stage_state(temporary, f"rng_state_{backend.process_index}", capture_rng(backend), staging))
    for i, loader in enumerate(objects.dataloaders):
        if _per_process(loader):
            pending.append(stage_state(temporary, _loader_file(i, backend.process_index), loader.state_dict(),
                                       staging))
    if main:
        for i, scheduler in enumerate(objects.schedulers):
            pending.append(stage_state(temporary, _name("scheduler", i), scheduler.state_dict(), staging))
        if precision_state := objects.precision.state_dict():
            pending.append(stage_state(temporary, "scaler", precision_state, staging))
        for i, loader in enumerate(objects.dataloaders):
            if not _per_process(loader):
                pending.append(stage_state(temporary, _name("dataloader", i), loader.state_dict(), staging))
        for i, obj in enumerate(objects.custom_objects):
            pending.append(stage_state(temporary, f"custom_checkpoint_{i}", obj.state_dict(), staging))
        counters = objects.counters
        pending.append(stage_state(temporary, "accelerator_state", {"step": counters.step, "micro_step": counters.micro_step,
                                                                    "seed": counters.seed}, staging))
    return pending, model_files


_DISK_FULL = "disk full"


def _write_checkpoint(backend: Backend, collectives: WriterCollectives, pending: list[Pending], model_files: int,
                      temporary: Path, final: Path, number: int, metadata: dict[str, Any] | None,
                      rotation: tuple[int | None, Callable[[Path], None] | None, Path]) -> Path:
    """Write the staged files, then commit: every rank's part is on disk and fsynced before the main
    process writes the manifest; then the main process rotates. The ranks agree on the outcome, so a
    failure anywhere raises the same sentence on every rank (nothing of this save committed). Runs on
    the main thread (synchronous save) or on every rank's writer thread, ``collectives`` between them."""
    rank = backend.process_index
    main = rank == 0
    outcome: tuple[str, Any]
    failure: BaseException | None = None
    try:
        written: dict[str, WrittenFile | Path] = {}
        for i, item in enumerate(pending):
            if main and i == model_files:
                store.fault_point("files", number, temporary, (metadata or {}).get("step"))
            written.update(item.write())
        # Durable before the manifest names them; hashed from memory while the disk flushes.
        digests = finish(written)
        outcome = ("ok", {k: (v.sha256, v.size) for k, v in digests.items()})
    except Exception as err:  # noqa: BLE001 - every rank must learn of it: agreed below, then raised
        failure = err
        disk_full = isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS
        outcome = (_DISK_FULL, None) if disk_full else ("error", f"{type(err).__name__}: {first_line(err)}")
    every_rank = collectives.all_gather_object(outcome)
    problem: tuple[str, str] | None = None
    if main:
        problem = _commit_or_explain(backend, every_rank, temporary, final, number, metadata, rotation)
    problem = collectives.broadcast_object(problem, src=0)
    if problem is not None:
        kind, sentence = problem
        error = DiskFullError(sentence) if kind == _DISK_FULL else CheckpointWriteError(sentence)
        raise error from failure
    return final


def _commit_or_explain(backend: Backend, every_rank: list[tuple[str, Any]], temporary: Path, final: Path, number: int,
                       metadata: dict[str, Any] | None,
                       rotation: tuple[int | None, Callable[[Path], None] | None, Path]) -> tuple[str, str] | None:
    """On the main process: commit the checkpoint every rank wrote, rotate and call ``on_complete``;
    None when all went well, else (kind, the sentence every rank raises)."""
    failed = [(rank, kind, detail) for rank, (kind, detail) in enumerate(every_rank) if kind != "ok"]
    if any(kind == _DISK_FULL for _, kind, _ in failed):
        # A partial checkpoint is never chosen (it has no manifest); removed now, not at the next save.
        return _DISK_FULL, str(store.disk_full(final.parent, temporary, final.name))
    if failed:
        rank, _, detail = failed[0]
        by = f" (process {rank}: {detail})" if backend.num_processes > 1 else f" ({detail})"
        return "error", (f"could not write checkpoint {final.name} in {final.parent}{by}; it was not committed, "
                         "and the earlier checkpoints are intact.")
    fields = {k: v for k, v in (metadata or {}).items() if k in _MANIFEST_FIELDS}
    extra = {k: v for k, v in (metadata or {}).items() if k not in _MANIFEST_FIELDS}
    files = {name: {"sha256": sha, "size": size} for _, part in every_rank for name, (sha, size) in part.items()}
    manifest = Manifest(save_number=number, world_size=backend.num_processes, files=dict(sorted(files.items())),
                        extra=extra, **fields)
    try:
        store.commit(temporary, final, manifest)
    except OSError as err:
        if err.errno in DISK_FULL_ERRNOS:
            return _DISK_FULL, str(store.disk_full(final.parent, temporary, final.name))
        return "error", (f"could not commit checkpoint {final.name} in {final.parent} ({first_line(err)}); "
                         "the earlier checkpoints are intact.")
    total_limit, on_complete, name_in_log = rotation
    # At DEBUG: one per save is clutter on a terminal (the engine's log file keeps it).
    log.debug("saved checkpoint %s (step %s)", name_in_log, manifest.step)
    try:
        if total_limit is not None:
            # ProjectConfiguration(total_limit=N), as in Accelerate: only the N newest project checkpoints
            # stay, removed once the new one is complete (never the one just written).
            store.rotate(final.parent, total_limit, keep_best=False, newest=final)
        if on_complete is not None:
            on_complete(final)
    except Exception as err:  # noqa: BLE001 - said on every rank, as the write's
        return "error", f"checkpoint {final} is complete, but what follows a save failed ({first_line(err)})."
    return None


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
    # The caller says why it loaded (resumed, exporting, evaluating).
    log.debug("loaded checkpoint %s (step %s, epoch %s)", shown(folder, project_dir), manifest.step, manifest.epoch)
    return manifest, counters


def shown(folder: Path, project_dir: Path | None) -> Path:
    """``folder`` as a log line names it: relative to the project (``checkpoints/checkpoint_3``) when inside it."""
    if project_dir is not None and folder.is_relative_to(project_dir):
        return folder.relative_to(project_dir)
    return folder
