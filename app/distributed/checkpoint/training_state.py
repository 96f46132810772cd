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
  ``custom_checkpoint_<i>.json|.safetensors`` (``register_for_checkpointing``; a registered ``nn.Module``
  is written as a model is, by every rank: gathered, or sharded under FSDP2);
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

import dataclasses
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
from app.run_folder.layout import checkpoint_name, checkpoints_dir

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend
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
    if output_dir is None and project_dir is None:
        raise ValueError("save_state() needs an output_dir, or an Accelerator built with project_dir.")

    def where() -> tuple[Path, int, str]:
        if output_dir is None:
            assert project_dir is not None
            root = checkpoints_dir(project_dir)
            number = store.next_save_number(root)
            return root / checkpoint_name(number), number, str(number)
        final = Path(output_dir)
        number = store.next_save_number(final.parent)
        return final, number, str(number)

    def stage(temporary: Path, staging: Staging) -> tuple[list[Pending], int]:
        return _stage(backend, objects, temporary, staging)

    return _save(backend, writer, async_save, lambda: _state_bytes(objects), where, stage, metadata,
                 (total_limit if output_dir is None else None, on_complete), project_dir)


def save_weights(backend: Backend, model: nn.Module, output_dir: Path, project_dir: Path | None,
                 metadata: dict[str, Any] | None = None, trainable_only: bool = False,
                 writer: BackgroundWriter | None = None, async_save: bool = False,
                 on_complete: Callable[[Path], None] | None = None) -> Path:
    """Write ``model``'s weights alone into ``output_dir`` (replaced when it exists), committed as a
    checkpoint is (files fsynced, a manifest listing them written last, the folder renamed into place;
    in the background with ``async_save``, as :func:`save_state`): ``model.safetensors``, or FSDP2's
    per-rank shards in ``model/``. ``trainable_only`` leaves frozen parameters out (they never change
    in training: a LoRA run's kept weights are its adapters and head). The manifest's ``extra`` says
    ``holds: weights`` (no training state: not resumable); its save number is the step recorded in
    ``metadata``. Every rank calls it; read back with :func:`load_weights`."""
    frozen = _frozen_names(backend.unwrap_model(model)) if trainable_only else set()

    def where() -> tuple[Path, int, str]:
        return output_dir, int((metadata or {}).get("step") or 0), output_dir.name

    def stage(temporary: Path, staging: Staging) -> tuple[list[Pending], int]:
        pending = backend.checkpoint_io.save_model(model, temporary, "model", staging,
                                                   keep=(lambda key: key not in frozen) if frozen else None)
        return pending, len(pending)

    return _save(backend, writer, async_save, lambda: _tensor_bytes(model.state_dict()), where, stage, {**(metadata or {}), HOLDS: WEIGHTS},
                 (None, on_complete), project_dir)


HOLDS, WEIGHTS = "holds", "weights"
"""A weights-only folder's manifest says ``extra["holds"] == "weights"``."""


def holds_weights_only(manifest: Manifest) -> bool:
    """Whether a committed folder is :func:`save_weights`'s (weights only), not a checkpoint."""
    return manifest.extra.get(HOLDS) == WEIGHTS


def _frozen_names(model: nn.Module) -> set[str]:
    """The state-dict names of the parameters that do not train (tied aliases included)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _save(backend: Backend, writer: BackgroundWriter | None, async_save: bool, needed_bytes: Callable[[], int],
          where: Callable[[], tuple[Path, int, str]], stage: Callable[[Path, Staging], tuple[list[Pending], int]],
          metadata: dict[str, Any] | None, rotation: tuple[int | None, Callable[[Path], None] | None],
          project_dir: Path | None) -> Path:
    """One save, of whatever ``stage`` stages: wait for the write in flight, agree on the folder
    (``where`` on the main process: final folder, save number, fault-point label), stage on this
    thread, then write and commit now or on the writer's thread (``async_save``)."""
    main = backend.process_index == 0
    if writer is not None:
        writer.wait()
    collectives: WriterCollectives | None = backend
    if writer is not None and async_save:
        collectives = backend.background_collectives() if _copy_fits(writer, needed_bytes) else None
    else:
        writer = None
    plan: tuple[str, str, int, str] | None = None
    if main:
        final, number, label = where()
        root = final.parent
        store.clean_temporaries(root)
        try:
            plan = (str(store.temporary_folder(root, label)), str(final), number, label)
        except OSError as err:
            if err.errno not in DISK_FULL_ERRNOS:
                raise
            raise store.disk_full(root, None, final.name) from None
    temporary_name, final_name, number, label = backend.broadcast_object(plan, src=0)
    temporary, final = Path(temporary_name), Path(final_name)
    in_background = writer is not None and collectives is not None
    staging = Staging(copy=in_background, pin_memory=backend.ops.pinned_memory,
                      buffers=writer.buffers if writer is not None else {},
                      process_group=getattr(collectives, "group", None) if in_background else None)
    try:
        pending, model_files = stage(temporary, staging)
    except OSError as err:  # a library that writes while staging (FSDP2's synchronous shards)
        if err.errno not in DISK_FULL_ERRNOS:
            raise
        raise store.disk_full(final.parent, temporary if main else None, final.name) from None
    total_limit, on_complete = rotation
    commit = _Commit(temporary, final, number, label, metadata, total_limit, on_complete, shown(final, project_dir))
    if not in_background:
        return _write_checkpoint(backend, backend, pending, model_files, commit)
    assert writer is not None and collectives is not None
    # Kept for the next asynchronous save (this one's and the earlier ones' of other files: a weights-only
    # save and a checkpoint share the model's buffers, and each keeps the other's).
    writer.buffers = {**writer.buffers, **staging.used}
    writer.start(lambda: _write_checkpoint(backend, collectives, pending, model_files, commit))
    return final


@dataclass
class _Commit:
    """Where a staged save goes and what follows its commit."""

    temporary: Path
    final: Path
    number: int
    label: str
    """The fault points' name for it (``checkpoint_<N>``: N; another folder: its name)."""
    metadata: dict[str, Any] | None
    total_limit: int | None
    on_complete: Callable[[Path], None] | None
    name_in_log: Path


def _state_bytes(objects: TrainingObjects) -> int:
    """The bytes of the models' and optimizers' tensors (what an asynchronous save copies)."""
    needed = sum(_tensor_bytes(model.state_dict()) for model in objects.models)
    return needed + sum(_tensor_bytes(optimizer.optimizer.state_dict()["state"]) for optimizer in objects.optimizers)


def _copy_fits(writer: BackgroundWriter, needed_bytes: Callable[[], int]) -> bool:
    """Whether an asynchronous save may copy the state: its buffers exist already (an earlier save
    made them), or one more copy leaves half of the available host memory free."""
    if writer.buffers:
        return True
    needed = needed_bytes()
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
    for i, obj in enumerate(objects.custom_objects):
        if isinstance(obj, nn.Module):  # a registered model (a reference that moves): saved as models are, every rank
            pending += io.save_model(obj, temporary, f"custom_checkpoint_{i}", dataclasses.replace(staging, now=True))
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
            if not isinstance(obj, nn.Module):
                pending.append(stage_state(temporary, f"custom_checkpoint_{i}", obj.state_dict(), staging))
        counters = objects.counters
        pending.append(stage_state(temporary, "accelerator_state", {"step": counters.step, "micro_step": counters.micro_step,
                                                                    "seed": counters.seed}, staging))
    return pending, model_files


_DISK_FULL = "disk full"


def _write_checkpoint(backend: Backend, collectives: WriterCollectives, pending: list[Pending], model_files: int,
                      commit: _Commit) -> Path:
    """Write the staged files, then commit: every rank's part is on disk and fsynced before the main
    process writes the manifest; then the main process rotates. The ranks agree on the outcome, so a
    failure anywhere raises the same sentence on every rank (nothing of this save committed). Runs on
    the main thread (synchronous save) or on every rank's writer thread, ``collectives`` between them."""
    rank = backend.process_index
    main = rank == 0
    outcome: tuple[str, Any]
    failure: BaseException | None = None
    step = (commit.metadata or {}).get("step")
    try:
        written: dict[str, WrittenFile | Path] = {}
        for i, item in enumerate(pending):
            if main and i == model_files:
                store.fault_point("files", commit.label, commit.temporary, step)
            written.update(item.write())
        if main and model_files >= len(pending):  # the model's files are all there is (save_weights)
            store.fault_point("files", commit.label, commit.temporary, step)
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
        problem = _commit_or_explain(backend, every_rank, commit)
    problem = collectives.broadcast_object(problem, src=0)
    if problem is not None:
        kind, sentence = problem
        error = DiskFullError(sentence) if kind == _DISK_FULL else CheckpointWriteError(sentence)
        raise error from failure
    return commit.final


def _commit_or_explain(backend: Backend, every_rank: list[tuple[str, Any]], commit: _Commit) -> tuple[str, str] | None:
    """On the main process: commit the checkpoint every rank wrote, rotate and call ``on_complete``;
    None when all went well, else (kind, the sentence every rank raises)."""
    temporary, final = commit.temporary, commit.final
    failed = [(rank, kind, detail) for rank, (kind, detail) in enumerate(every_rank) if kind != "ok"]
    if any(kind == _DISK_FULL for _, kind, _ in failed):
        # A partial checkpoint is never chosen (it has no manifest); removed now, not at the next save.
        return _DISK_FULL, str(store.disk_full(final.parent, temporary, final.name))
    if failed:
        rank, _, detail = failed[0]
        by = f" (process {rank}: {detail})" if backend.num_processes > 1 else f" ({detail})"
        return "error", (f"could not write checkpoint {final.name} in {final.parent}{by}; it was not committed, "
                         "and the earlier checkpoints are intact.")
    metadata = commit.metadata or {}
    fields = {k: v for k, v in metadata.items() if k in _MANIFEST_FIELDS}
    extra = {k: v for k, v in metadata.items() if k not in _MANIFEST_FIELDS}
    files = {name: {"sha256": sha, "size": size} for _, part in every_rank for name, (sha, size) in part.items()}
    manifest = Manifest(save_number=commit.number, world_size=backend.num_processes, files=dict(sorted(files.items())),
                        extra=extra, **fields)
    try:
        store.commit(temporary, final, manifest, label=commit.label)
    except OSError as err:
        if err.errno in DISK_FULL_ERRNOS:
            return _DISK_FULL, str(store.disk_full(final.parent, temporary, final.name))
        return "error", (f"could not commit checkpoint {final.name} in {final.parent} ({first_line(err)}); "
                         "the earlier checkpoints are intact.")
    # At DEBUG: one per save is clutter on a terminal (the engine's log file keeps it).
    log.debug("saved %s %s (step %s)", "weights" if holds_weights_only(manifest) else "checkpoint",
              commit.name_in_log, manifest.step)
    try:
        if commit.total_limit is not None:
            # ProjectConfiguration(total_limit=N), as in Accelerate: only the N newest project checkpoints
            # stay, removed once the new one is complete (never the one just written).
            store.rotate(final.parent, commit.total_limit, keep_best=False, newest=final)
        if commit.on_complete is not None:
            commit.on_complete(final)
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
                input_dir = checkpoints_dir(project_dir)
            chosen = store.find_checkpoint(Path(input_dir))
            manifest = store.read_manifest(chosen)
            assert manifest is not None  # verified
            if holds_weights_only(manifest):
                raise CheckpointError(
                    f"{chosen} holds only the weights of the evaluation at step {manifest.step} (no optimizer, "
                    "data position or loop state), so training cannot continue from it; resume from the run folder, "
                    "whose export model/ holds these weights.")
            recorded = manifest.config_hash
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
        if isinstance(obj, nn.Module):
            io.load_model(obj, folder, f"custom_checkpoint_{i}")
        else:
            load_into(obj, folder, f"custom_checkpoint_{i}")
    saved = read_state(folder, "accelerator_state")
    counters = Counters(step=int(saved["step"]), micro_step=int(saved["micro_step"]),
                        seed=int(saved["seed"]) if saved.get("seed") is not None else objects.counters.seed)
    restore_rng(folder, backend, manifest)
    # The caller says why it loaded (resumed, exporting, evaluating).
    log.debug("loaded checkpoint %s (step %s, epoch %s)", shown(folder, project_dir), manifest.step, manifest.epoch)
    return manifest, counters


def load_weights(backend: Backend, model: nn.Module, input_dir: Path) -> Manifest:
    """Load what :func:`save_weights` wrote into ``model`` (the weights it holds; a frozen parameter it
    left out keeps its value) after the main process verified the folder (its manifest, sizes and
    SHA-256); every rank raises CheckpointError (one sentence) when it does not verify. Returns the
    folder's manifest."""
    problem: str | None = None
    if backend.process_index == 0:
        problem = store.verify(input_dir)
        manifest = store.read_manifest(input_dir)
        if problem is None and manifest is not None and not holds_weights_only(manifest):
            problem = "it is a checkpoint, not a folder of weights (load it with load_state)"
    problem = backend.broadcast_object(problem, src=0)
    if problem is not None:
        raise CheckpointError(f"cannot load the weights in {input_dir}: {problem}.")
    manifest = store.read_manifest(input_dir)
    assert manifest is not None
    backend.checkpoint_io.load_model(model, input_dir, "model", partial=True)
    return manifest


def shown(folder: Path, project_dir: Path | None) -> Path:
    """``folder`` as a log line names it: relative to the project (``checkpoints/checkpoint_3``) when inside it."""
    if project_dir is not None and folder.is_relative_to(project_dir):
        return folder.relative_to(project_dir)
    return folder
