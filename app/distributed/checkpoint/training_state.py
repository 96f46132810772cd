"""``Accelerator.save_state`` / ``load_state`` / ``save_model``: what goes into a checkpoint folder.

A checkpoint folder holds (names as Accelerate's, ``_<i>`` for the i-th object of a kind after the
first; see ``checkpoint_store`` for the folder's life-cycle and ``checkpoint_format`` for the files):

- ``model.safetensors``: the full weights (the backend may write shards instead, see
  ``Backend.save_model_state``);
- ``optimizer.safetensors``: optimizer tensors, with the rest of its state as JSON in the header;
- ``scheduler.json``, ``scaler.json`` (fp16 only), ``dataloader.json`` (epoch, seed, samples
  consumed in the epoch), ``custom_checkpoint_<i>.json|.safetensors`` (``register_for_checkpointing``);
- ``rng_state_<rank>.safetensors``: python, numpy, torch (and the device's, ``Backend.rng_state``)
  RNG states of every rank;
- ``accelerator_state.json``; and ``manifest.json``, written last.

Every rank calls save_state and load_state (they contain collectives). The main process verifies
a checkpoint before loading and tells the others the outcome, so all ranks fail alike.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from app.distributed import checkpoint_store as store
from app.distributed.checkpoint_format import (
    WrittenFile,
    dedupe_shared,
    finish,
    fsync_path,
    read_safetensors,
    read_state,
    state_file,
    write_bytes,
    write_safetensors,
    write_state,
)
from app.distributed.checkpoint_store import CheckpointError, Manifest

if TYPE_CHECKING:
    from app.distributed.accelerator import Accelerator
    from app.distributed.backend import Backend

log = logging.getLogger(__name__)

_MANIFEST_FIELDS = ("step", "epoch", "config_hash", "metric")


def _name(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}_{index}"


# -- save ------------------------------------------------------------------------------------------


def save_state(acc: Accelerator, output_dir: str | os.PathLike[str] | None = None,
               metadata: dict[str, Any] | None = None) -> Path:
    """Write the whole training state atomically; returns the checkpoint folder.

    Without ``output_dir`` the folder is ``<project_dir>/checkpoints/checkpoint_<N>``, N continuing
    from the manifests already there. ``metadata`` keys step, epoch, config_hash and metric go to
    the manifest's fields, any other key to its ``extra``.
    """
    backend = acc.backend
    if output_dir is None and acc.project_dir is None:
        raise ValueError("save_state() needs an output_dir, or an Accelerator built with project_dir.")
    plan: tuple[str, str, int] | None = None
    if acc.is_main_process:
        if output_dir is None:
            assert acc.project_dir is not None
            root = acc.project_dir / store.CHECKPOINTS
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
            if err.errno not in store.DISK_FULL_ERRNOS:
                raise
            raise store.disk_full(root, None, f"checkpoint_{number}") from None
    temporary_name, final_name, number = backend.broadcast_object(plan, src=0)
    temporary, final = Path(temporary_name), Path(final_name)
    try:
        saved = _write_checkpoint(acc, temporary, final, number, metadata)
    except OSError as err:
        if err.errno not in store.DISK_FULL_ERRNOS:
            raise
        # A partial checkpoint is never chosen (it has no manifest); remove it now, not at the next save.
        raise store.disk_full(final.parent, temporary if acc.is_main_process else None, final.name) from None
    limit = acc.project_configuration.total_limit
    if output_dir is None and limit is not None:  # the same on every rank
        # ProjectConfiguration(total_limit=N), as in Accelerate: only the N newest project checkpoints
        # stay, removed once the new one is complete (never the one just written); nobody moves on
        # (to load one) while the main process rotates.
        if acc.is_main_process:
            store.rotate(saved.parent, limit, keep_best=False, newest=saved)
        acc.wait_for_everyone()
    return saved


def _write_checkpoint(acc: Accelerator, temporary: Path, final: Path, number: int,
                      metadata: dict[str, Any] | None) -> Path:
    backend = acc.backend

    written: dict[str, WrittenFile | Path] = {}
    for i, model in enumerate(acc._models):
        written.update(backend.save_model_state(model, temporary, _name("model", i)))
    if acc.is_main_process:
        store.fault_point("files", number, temporary)
    for i, optimizer in enumerate(acc._optimizers):
        written.update(backend.save_optimizer_state(_owner(acc, optimizer), optimizer.optimizer, temporary,
                                                    _name("optimizer", i)))
    written.update(write_state(temporary, f"rng_state_{acc.process_index}", capture_rng(backend)))
    if acc.is_main_process:
        for i, scheduler in enumerate(acc._schedulers):
            written.update(write_state(temporary, _name("scheduler", i), scheduler.state_dict()))
        if precision_state := acc.precision.state_dict():
            written.update(write_state(temporary, "scaler", precision_state))
        for i, loader in enumerate(acc._dataloaders):
            written.update(write_state(temporary, _name("dataloader", i), loader.state_dict()))
        for i, obj in enumerate(acc._custom_objects):
            written.update(write_state(temporary, f"custom_checkpoint_{i}", obj.state_dict()))
        written.update(write_state(temporary, "accelerator_state",
                                   {"step": acc.step, "micro_step": acc._micro_step, "seed": acc._seed}))

    # Durable before the manifest names them; hashed from memory while the disk flushes.
    digests = finish(written)
    every_rank = backend.all_gather_object({k: (v.sha256, v.size) for k, v in digests.items()})
    if acc.is_main_process:
        fields = {k: v for k, v in (metadata or {}).items() if k in _MANIFEST_FIELDS}
        extra = {k: v for k, v in (metadata or {}).items() if k not in _MANIFEST_FIELDS}
        files = {name: {"sha256": sha, "size": size} for part in every_rank for name, (sha, size) in part.items()}
        manifest = Manifest(save_number=number, world_size=acc.num_processes, files=dict(sorted(files.items())),
                            extra=extra, **fields)
        store.commit(temporary, final, manifest)
        log.info("saved checkpoint %s (step %s)", final, manifest.step)
    # Nobody moves on (to rotate, or to read it) before the checkpoint is in place.
    backend.barrier()
    return final


def _owner(acc: Accelerator, optimizer: Any) -> nn.Module | None:
    """The prepared model whose parameters this optimizer updates (FSDP2 needs it to name states)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in acc._models:
        if any(id(p) in params for p in model.parameters()):
            return model
    return None


# -- load ------------------------------------------------------------------------------------------


def load_state(acc: Accelerator, input_dir: str | os.PathLike[str] | None = None,
               config_hash: str | None = None) -> Manifest:
    """Restore what :func:`save_state` wrote, RNG states last; returns the checkpoint's manifest.

    ``input_dir`` may be a checkpoint, a ``checkpoints/`` folder or a run folder (the newest
    checkpoint that verifies is used); without it, the project's ``checkpoints/``. With
    ``config_hash``, a checkpoint recording another one is refused before anything is loaded.
    Raises CheckpointError (one sentence) on every rank when there is no usable checkpoint.
    """
    backend = acc.backend
    outcome: tuple[str, str] | None = None
    if acc.is_main_process:
        try:
            if input_dir is None:
                if acc.project_dir is None:
                    raise CheckpointError("load_state() needs an input_dir, or an Accelerator built with project_dir.")
                input_dir = acc.project_dir / store.CHECKPOINTS
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
    if acc.is_main_process and (unlisted := store.unlisted_files(folder)):
        log.warning("ignoring %s in %s: the manifest does not list them (only listed files are loaded)",
                    ", ".join(unlisted), folder)

    for i, model in enumerate(acc._models):
        backend.load_model_state(model, folder, _name("model", i))
    for i, optimizer in enumerate(acc._optimizers):
        backend.load_optimizer_state(_owner(acc, optimizer), optimizer.optimizer, folder, _name("optimizer", i))
    for i, scheduler in enumerate(acc._schedulers):
        _load_into(scheduler, folder, _name("scheduler", i))
    if state_file(folder, "scaler") is not None:
        acc.precision.load_state_dict(read_state(folder, "scaler"))
    for i, loader in enumerate(acc._dataloaders):
        _load_into(loader, folder, _name("dataloader", i))
    for i, obj in enumerate(acc._custom_objects):
        _load_into(obj, folder, f"custom_checkpoint_{i}")
    counters = read_state(folder, "accelerator_state")
    acc.step, acc._micro_step = int(counters["step"]), int(counters["micro_step"])
    if counters.get("seed") is not None:
        acc._seed = int(counters["seed"])
    restore_rng(folder, acc.backend, manifest)
    log.info("resumed from %s (step %s, epoch %s)", folder, manifest.step, manifest.epoch)
    return manifest


def _load_into(obj: Any, folder: Path, name: str, convert: Callable[[Any], Any] | None = None) -> None:
    try:
        state = read_state(folder, name)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {name} state, so it was saved with different objects "
                              f"(another script or config?).") from None
    try:
        obj.load_state_dict(convert(state) if convert is not None else state)
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"the {name} state in {folder} does not fit this run ({_first_line(err)}).") from None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")


# -- model and optimizer, full state (the Backend's default hooks) -------------------------------------


def save_full_model_state(backend: Backend, model: nn.Module, folder: Path, name: str) -> dict[str, WrittenFile]:
    """``<name>.safetensors`` with the full weights, written by the main process (tied weights are
    stored once and recorded as aliases)."""
    state = backend.full_state_dict(model)
    if backend.process_index != 0:
        return {}
    unique, aliases = dedupe_shared(state)
    file = f"{name}.safetensors"
    metadata = {"format": "pt", "aliases": json.dumps(aliases)}
    return {file: write_safetensors(folder / file, unique, metadata)}


def read_full_model_state(folder: Path, name: str) -> dict[str, torch.Tensor]:
    tensors, metadata = read_safetensors(folder / f"{name}.safetensors")
    for alias, original in json.loads(metadata.get("aliases", "{}")).items():
        tensors[alias] = tensors[original]
    return tensors


def check_compatible(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], where: Path) -> None:
    """One sentence naming the first difference between the model and a checkpoint's weights."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"the weights in {where} do not match the model ({detail}); "
                              "was it saved for another task or model?")
    for key, tensor in expected.items():
        if tuple(found[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"the weights in {where} do not match the model ({key} has shape "
                                  f"{tuple(found[key].shape)} there, {tuple(tensor.shape)} here); "
                                  "was it saved for another task or model?")


def load_full_model_state(backend: Backend, model: nn.Module, folder: Path, name: str) -> None:
    """Every rank reads the full weights into its (replicated) model, from ``<name>.safetensors`` or
    from the shards an FSDP2 run wrote."""
    from app.distributed.checkpoint_fsdp import read_sharded_model_state, sharded_shapes

    inner = backend.unwrap_model(model)
    path = folder / f"{name}.safetensors"
    listed = store.listed_files(folder)
    if path.name in listed if listed is not None else path.is_file():
        state = read_full_model_state(folder, name)
        check_compatible(inner.state_dict(), state, path)
    elif store.lists_folder(folder, name) if listed is not None else (folder / name).is_dir():
        check_compatible(inner.state_dict(), sharded_shapes(folder / name), folder / name)
        state = read_sharded_model_state(folder / name, inner.state_dict())
    else:
        raise CheckpointError(f"{folder} has no {path.name}, so it was saved with a different model setup.")
    inner.load_state_dict(state, strict=True)


def save_full_optimizer_state(backend: Backend, model: nn.Module | None, optimizer: torch.optim.Optimizer,
                              folder: Path, name: str) -> dict[str, WrittenFile]:
    """The optimizer's state, written by the main process (DDP replicates it on every rank)."""
    if backend.process_index != 0:
        return {}
    return write_state(folder, name, optimizer.state_dict())


def load_full_optimizer_state(backend: Backend, model: nn.Module | None, optimizer: torch.optim.Optimizer,
                              folder: Path, name: str) -> None:
    """Every rank loads the whole state (keyed by parameter name when an FSDP2 run saved it)."""
    from app.distributed.checkpoint_fsdp import by_parameter_index

    inner = backend.unwrap_model(model) if model is not None else None
    _load_into(optimizer, folder, name,
               convert=lambda state: keep_implementation(by_parameter_index(state, inner, optimizer), optimizer))


_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""Param-group entries that choose the optimizer's kernels for this run's device, not training state."""


def keep_implementation(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The saved state with this optimizer's kernel choices: a checkpoint written on a device with
    fused kernels (CPU) must not ask for them on one without (XLA), and the other way round."""
    for saved, current in zip(state.get("param_groups", []), optimizer.param_groups):
        for key in _IMPLEMENTATION_KEYS:
            if key in current:
                saved[key] = current[key]
    return state


# -- RNG -------------------------------------------------------------------------------------------


def capture_rng(backend: Backend) -> dict[str, Any]:
    """This process's RNG states in a form :func:`checkpoint_format.flatten` stores without pickle;
    the device's (e.g. ``cuda``) come from the backend, under the keys its ``DeviceOps`` chose."""
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "key": np.asarray(key).tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    state.update(backend.rng_state())
    return state


def apply_rng(state: dict[str, Any], backend: Backend) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    backend.set_rng_state(state)


def restore_rng(folder: Path, backend: Backend, manifest: Manifest) -> None:
    """Restore this rank's RNG states. A rank that did not exist when the checkpoint was written
    (more processes now) gets fresh streams seeded from the step and its rank: dropout masks and
    the like cannot continue exactly across a change of world size."""
    rank = backend.process_index
    if state_file(folder, f"rng_state_{rank}") is not None:
        apply_rng(read_state(folder, f"rng_state_{rank}"), backend)
        return
    seed = (manifest.step * 1_000_003 + rank) % 2**31
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# -- exported models (save_model) ----------------------------------------------------------------------

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


def save_model(acc: Accelerator, model: nn.Module, save_directory: str | os.PathLike[str],
               max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
    """Write the model's full weights the way transformers does: ``model.safetensors``, or
    ``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``
    (``pytorch_model*.bin`` with ``safe_serialization=False``). Every rank must call it (FSDP2
    gathers the weights); the main process writes. Each file is written under a temporary name and
    renamed; shards of an earlier save that this one does not use are removed.
    """
    max_bytes = parse_size(max_shard_size)
    state = acc.backend.full_state_dict(model)
    if acc.is_main_process:
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        inner = acc.unwrap_model(model)
        targets = tied_targets(inner)
        unique, aliases = dedupe_shared(state, drop_first=targets)
        untied = sorted(a for a in aliases if a not in targets)
        if untied:
            log.warning("save_model stored tensors sharing memory once; %s will be missing from %s "
                        "(tie them again after loading).", untied, folder)
        _write_weights(folder, shard(unique, max_bytes), safe_serialization)
    acc.wait_for_everyone()


def _write_weights(folder: Path, shards: list[dict[str, torch.Tensor]], safe: bool) -> None:
    stem, suffix = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    names = ([f"{stem}.{suffix}"] if len(shards) == 1
             else [f"{stem}-{i:05d}-of-{len(shards):05d}.{suffix}" for i in range(1, len(shards) + 1)])
    index_name = f"{stem}.{suffix}.index.json"
    for name, tensors in zip(names, shards):
        temporary = folder / f".{name}.tmp-{secrets.token_hex(4)}"
        if safe:
            finish({name: write_safetensors(temporary, tensors, {"format": "pt"})})
        else:
            torch.save({k: v.contiguous() for k, v in tensors.items()}, temporary)
            fsync_path(temporary)
        os.replace(temporary, folder / name)
    stale = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.{suffix}")
    for old in folder.iterdir():
        if stale.fullmatch(old.name) and old.name not in names:
            old.unlink()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
                 "weight_map": {k: name for name, s in zip(names, shards) for k in s}}
        temporary = folder / f".{index_name}.tmp-{secrets.token_hex(4)}"
        write_bytes(temporary, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        fsync_path(temporary)
        os.replace(temporary, folder / index_name)
    elif (folder / index_name).exists():
        (folder / index_name).unlink()
    fsync_path(folder)

