"""The two layouts of a checkpoint's model and optimizer state, and how one process reads either.

- *Full*: ``<name>.safetensors`` holds the whole model (tied weights stored once, their other names
  in the header's ``aliases``); the optimizer state is keyed by parameter index, as
  ``optimizer.state_dict()`` gives it (one process, DDP, XLA).
- *Sharded*: ``<name>/shard-<rank>-model-00001-of-00001.safetensors``, one file per rank written by
  ``torch.distributed.checkpoint`` (its sharding in each header's ``DCP_SHARDING_INFO``); the optimizer
  state is keyed by parameter name, as torch's distributed state-dict API gives it (FSDP2).

A checkpoint moves between world sizes and between backends: every reader here runs in one process,
without a collective, and each I/O (``io.FullStateIO``, ``sharded_io.ShardedStateIO``) reads both.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.distributed.checkpoint.errors import CheckpointError
from app.distributed.checkpoint.format import read_safetensors

# -- model weights --------------------------------------------------------------------------------


def full_model_files(folder: Path, name: str, listed: set[str] | None = None) -> list[str]:
    """The files holding the full weights ``name`` in ``folder``: ``<name>.safetensors``, or the shards
    that ``<name>.safetensors.index.json`` maps (an export with ``max_shard_size``, as transformers
    writes them); empty when there are none. ``listed``: a checkpoint's manifest files (else the disk)."""
    def present(file: str) -> bool:
        return file in listed if listed is not None else (folder / file).is_file()

    if present(f"{name}.safetensors"):
        return [f"{name}.safetensors"]
    index = f"{name}.safetensors.index.json"
    if not present(index):
        return []
    try:
        weight_map = json.loads((folder / index).read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{folder / index} is not a readable index of weight shards ({err}).") from None
    if missing := [shard for shard in shards if "/" in shard or not present(shard)]:
        raise CheckpointError(f"{folder / index} names {missing[0]}, which is not a file beside it.")
    return shards


def read_full_model_state(folder: Path, files: list[str]) -> dict[str, torch.Tensor]:
    """The weights in ``files`` (what :func:`full_model_files` found), shards merged."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        shard, metadata = read_safetensors(folder / file)
        for alias, original in json.loads(metadata.get("aliases", "{}")).items():
            shard[alias] = shard[original]
        tensors.update(shard)
    return tensors


def read_sharded_model_state(folder: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights from a folder of shards, read by this process alone (no collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = {k: torch.empty_like(v, device="cpu") for k, v in expected.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    return state


def sharded_shapes(folder: Path) -> dict[str, torch.Tensor]:
    """Each tensor's global shape (as an empty meta tensor), from the shard files' headers."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            info = json.loads((f.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                local = f.get_slice(key).get_shape()
                offsets = info.get(key, {}).get("saved_offsets", [0] * len(local))
                end = [o + n for o, n in zip(offsets, local)]
                if key in found:
                    end = [max(a, b) for a, b in zip(end, found[key].shape)]
                found[key] = torch.empty(end, device="meta")
    return found


def saved_part(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's entries that a partial save (``save_weights(trainable_only=True)``) holds: what
    :func:`check_compatible` compares it with (a name the save has and the model lacks is still refused)."""
    return {k: v for k, v in expected.items() if k in found}


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


# -- optimizer state ------------------------------------------------------------------------------


def by_parameter_name(state: dict[str, Any], model: nn.Module | None, optimizer: torch.optim.Optimizer
                      ) -> dict[str, Any]:
    """An optimizer state keyed by parameter index (``optimizer.state_dict()``, as a single process
    or DDP saves it) re-keyed by parameter name, as torch's distributed state-dict API wants it."""
    if model is None or all(isinstance(k, str) for k in state.get("state", {})):
        return state
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {order[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def by_parameter_index(state: dict[str, Any], model: nn.Module | None, optimizer: torch.optim.Optimizer
                       ) -> dict[str, Any]:
    """The reverse of :func:`by_parameter_name`, for ``optimizer.load_state_dict``."""
    if model is None or not any(isinstance(k, str) for k in state.get("state", {})):
        return state
    names = {id(p): n for n, p in model.named_parameters()}
    index = {names[id(p)]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups}


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
