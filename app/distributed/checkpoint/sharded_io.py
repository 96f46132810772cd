"""FSDP2 checkpoint files: each rank writes its own shard of the weights with
``torch.distributed.checkpoint`` in safetensors form (``<name>/shard-0000<r>-model-00001-of-00001.safetensors``,
the sharding recorded in each file's header: no pickle anywhere), and the optimizer state is
gathered to rank 0 keyed by parameter name.

Loading re-shards: any number of FSDP2 ranks reads the shard files, and a single process or DDP
reads them too (:func:`read_sharded_model_state`), so a checkpoint moves between world sizes and
between backends. ``FSDPBackend`` delegates its checkpoint hooks here.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.distributed.checkpoint_format import WrittenFile, read_state, state_file, write_state
from app.distributed.checkpoint_store import CheckpointError

if TYPE_CHECKING:
    from app.distributed.backend import Backend


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def save_model_state(backend: Backend, model: nn.Module, folder: Path, name: str) -> dict[str, Path]:
    """Every rank writes its shards (a collective); returns the files this rank wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    target = folder / name
    dcp.save(get_model_state_dict(model), storage_writer=HuggingFaceStorageWriter(str(target), save_distributed=True))
    # The writer numbers shard files by rank, from 1.
    mine = sorted(target.glob(f"shard-{backend.process_index + 1:05d}-*.safetensors"))
    return {f"{name}/{path.name}": path for path in mine}


def read_sharded_model_state(folder: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights from a folder of shards, read by this process alone (no collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = {k: torch.empty_like(v, device="cpu") for k, v in expected.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    return state


def load_model_state(backend: Backend, model: nn.Module, folder: Path, name: str) -> None:
    """From shards (re-sharded to this world size) or from a full ``<name>.safetensors``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from app.distributed.checkpoint_store import listed_files, lists_folder
    from app.distributed.checkpointing import check_compatible, read_full_model_state

    listed = listed_files(folder)
    if lists_folder(folder, name) if listed is not None else (folder / name).is_dir():
        state = get_model_state_dict(model)
        _check_shapes(backend, state, folder / name)
        try:
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder / name)))
        except Exception as err:  # noqa: BLE001 - DCP wraps reader errors in CheckpointException
            raise CheckpointError(f"cannot read the weight shards in {folder / name} ({_first_line(err)}).") from None
        set_model_state_dict(model, state)
        return
    path = folder / f"{name}.safetensors"
    if not (path.name in listed if listed is not None else path.is_file()):
        raise CheckpointError(f"{folder} has neither {name}/ shards nor {path.name}.")
    full: dict[str, torch.Tensor] = {}
    expected = backend.full_state_dict(model)  # a collective: the full shapes, on rank 0

    def read() -> None:
        full.update(read_full_model_state(folder, name))
        check_compatible(expected, full, path)

    _on_rank0_for_all(backend, read)
    set_model_state_dict(model, full, options=_options(full_state_dict=True, broadcast_from_rank0=True))  # type: ignore[arg-type]


def _on_rank0_for_all(backend: Backend, work: Any) -> None:
    """Run ``work`` on rank 0; a CheckpointError it raises is raised on every rank (the others
    would otherwise wait in the next collective until it times out)."""
    problem = None
    if backend.process_index == 0:
        try:
            work()
        except CheckpointError as err:
            problem = str(err)
    problem = backend.broadcast_object(problem, src=0)
    if problem is not None:
        raise CheckpointError(problem)


def _check_shapes(backend: Backend, state: dict[str, Any], folder: Path) -> None:
    """Compare the model's global shapes with the shard headers, on every rank alike."""
    from app.distributed.checkpointing import check_compatible

    check_compatible({k: torch.empty(tuple(v.shape), device="meta") for k, v in state.items()},
                     sharded_shapes(folder), folder)


def sharded_shapes(folder: Path) -> dict[str, torch.Tensor]:
    """Each tensor's global shape (as an empty meta tensor), from the shard files' headers."""
    import json

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


def save_optimizer_state(backend: Backend, model: nn.Module | None, optimizer: torch.optim.Optimizer,
                         folder: Path, name: str) -> dict[str, WrittenFile]:
    """The full optimizer state keyed by parameter name, gathered to rank 0 (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    assert model is not None, "an FSDP2 optimizer belongs to a prepared model"
    state = get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))
    return write_state(folder, name, state) if backend.process_index == 0 else {}


def load_optimizer_state(backend: Backend, model: nn.Module | None, optimizer: torch.optim.Optimizer,
                         folder: Path, name: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    assert model is not None, "an FSDP2 optimizer belongs to a prepared model"
    if state_file(folder, name) is None:
        raise CheckpointError(f"{folder} has no {name} state, so it was saved with a different optimizer setup.")
    state: dict[str, Any] = {}

    def read() -> None:
        try:
            state.update(by_parameter_name(read_state(folder, name), model, optimizer))
        except (KeyError, IndexError) as err:
            raise CheckpointError(f"the {name} state in {folder} does not fit this optimizer "
                                  f"(no parameter {err}).") from None

    _on_rank0_for_all(backend, read)
    try:
        set_optimizer_state_dict(model, optimizer, state,
                                 options=_options(full_state_dict=True, broadcast_from_rank0=True))
    except (KeyError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"the {name} state in {folder} does not fit this optimizer ({_first_line(err)}).") from None


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


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
