"""FSDP2's checkpoint I/O: each rank writes its own shard of the weights with
``torch.distributed.checkpoint`` in safetensors form (``<name>/shard-0000<r>-model-00001-of-00001.safetensors``,
the sharding recorded in each file's header: no pickle anywhere), and the optimizer state is
gathered to rank 0 keyed by parameter name.

Loading re-shards: any number of FSDP2 ranks reads the shard files, and a single process or DDP
reads them too (``layouts.read_sharded_model_state``), so a checkpoint moves between world sizes and
between backends. ``FSDPBackend.checkpoint_io`` is a :class:`ShardedStateIO`.

An asynchronous save hands the shards to ``torch.distributed.checkpoint.async_save``, which copies
them to host memory at once and writes them on a thread of its own, its ranks synchronising on the
checkpoint writers' process group (``staging.process_group``), never on the training's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.distributed.checkpoint.errors import CheckpointError, first_line
from app.distributed.checkpoint.format import WrittenFile, stage_state
from app.distributed.checkpoint.layouts import (
    by_parameter_name,
    check_compatible,
    full_model_files,
    keep_implementation,
    read_full_model_state,
    saved_part,
    sharded_shapes,
)
from app.distributed.checkpoint.staging import Pending, Staging
from app.distributed.checkpoint.store import listed_files, lists_folder, read_state, state_file

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


class ShardedStateIO:
    """Weights as one shard file per rank; the optimizer state whole, keyed by parameter name."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def save_model(self, model: nn.Module, folder: Path, name: str, staging: Staging,
                   keep: Callable[[str], bool] | None = None) -> list[Pending]:
        """Every rank writes its shards (a collective): now, or (``staging.copy``) from a host copy on
        torch.distributed.checkpoint's thread."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        target = folder / name
        writer = HuggingFaceStorageWriter(str(target), save_distributed=True)
        state = get_model_state_dict(model)
        if keep is not None:
            state = {k: v for k, v in state.items() if keep(k)}
        if not staging.copy or staging.now:
            dcp.save(state, storage_writer=writer)
            return [PendingShards(name, target, self.backend.process_index)]
        started = dcp.async_save(state, storage_writer=writer, process_group=staging.process_group)
        return [PendingShards(name, target, self.backend.process_index, getattr(started, "upload_completion", started))]

    def load_model(self, model: nn.Module, folder: Path, name: str, partial: bool = False) -> None:
        """From shards (re-sharded to this world size) or from a full ``<name>.safetensors``; ``partial``:
        only the entries saved (``save_model(keep=...)``), the others stay."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        listed = listed_files(folder)
        if lists_folder(folder, name) if listed is not None else (folder / name).is_dir():
            state: dict[str, Any] = get_model_state_dict(model)
            shapes = sharded_shapes(folder / name)
            if partial:
                state = saved_part(state, shapes)
            # The model's global shapes against the shard headers, on every rank alike.
            check_compatible({k: torch.empty(tuple(v.shape), device="meta") for k, v in state.items()},
                             shapes, folder / name)
            try:
                dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder / name)))
            except Exception as err:  # noqa: BLE001 - DCP wraps reader errors in CheckpointException
                raise CheckpointError(f"cannot read the weight shards in {folder / name} ({first_line(err)}).") from None
            set_model_state_dict(model, state, options=_options(strict=not partial))
            return
        path = folder / f"{name}.safetensors"
        files = full_model_files(folder, name, listed)
        if not files:
            raise CheckpointError(f"{folder} has neither {name}/ shards nor {path.name}.")
        full: dict[str, torch.Tensor] = {}
        expected = self.backend.full_state_dict(model)  # a collective: the full shapes, on rank 0

        def read() -> None:
            full.update(read_full_model_state(folder, files))
            check_compatible(saved_part(expected, full) if partial else expected, full, path)

        self._on_rank0_for_all(read)
        set_model_state_dict(model, full, options=_options(full_state_dict=True, broadcast_from_rank0=True,  # type: ignore[arg-type]
                                                           strict=not partial))

    def save_optimizer(self, model: nn.Module | None, optimizer: torch.optim.Optimizer, folder: Path,
                       name: str, staging: Staging) -> list[Pending]:
        """The full optimizer state keyed by parameter name, gathered to rank 0 (a collective)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert model is not None, "an FSDP2 optimizer belongs to a prepared model"
        state = get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))
        return [stage_state(folder, name, state, staging)] if self.backend.process_index == 0 else []

    def load_optimizer(self, model: nn.Module | None, optimizer: torch.optim.Optimizer, folder: Path,
                       name: str) -> None:
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

        self._on_rank0_for_all(read)
        # An optimizer that keeps no tensor per parameter (SGD without momentum) has only its groups' settings
        # to load: torch.distributed.checkpoint cannot place a state without a tensor ("Expected device to be set").
        groups = self.backend.broadcast_object(
            state["param_groups"] if self.backend.process_index == 0 and not holds_tensors(state.get("state", {})) else None,
            src=0)
        if groups is not None:
            load_group_settings(optimizer, groups, f"the {name} state in {folder}")
            return
        try:
            set_optimizer_state_dict(model, optimizer, state,
                                     options=_options(full_state_dict=True, broadcast_from_rank0=True))
        except (KeyError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"the {name} state in {folder} does not fit this optimizer "
                                  f"({first_line(err)}).") from None

    def _on_rank0_for_all(self, work: Callable[[], None]) -> None:
        """Run ``work`` on rank 0; a CheckpointError it raises is raised on every rank (the others
        would otherwise wait in the next collective until it times out)."""
        problem = None
        if self.backend.process_index == 0:
            try:
                work()
            except CheckpointError as err:
                problem = str(err)
        problem = self.backend.broadcast_object(problem, src=0)
        if problem is not None:
            raise CheckpointError(problem)


def holds_tensors(per_parameter: dict[str, Any]) -> bool:
    """Whether an optimizer state (per parameter) holds a tensor with at least one dimension."""
    return any(isinstance(value, torch.Tensor) and value.dim() > 0
               for values in per_parameter.values() for value in values.values())


def load_group_settings(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], what: str) -> None:
    """The saved parameter groups' settings (learning rate, momentum... all but their parameters, and with this
    run's kernel choices: ``layouts.keep_implementation``, as a plain load keeps them) into ``optimizer``'s groups,
    in order."""
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{what} has {len(groups)} parameter group(s) and this optimizer "
                              f"{len(optimizer.param_groups)}: it was saved with a different optimizer setup.")
    groups = keep_implementation({"param_groups": groups}, optimizer)["param_groups"]
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})


@dataclass
class PendingShards:
    """This rank's weight shards in ``target``, written by torch.distributed.checkpoint: already (a
    synchronous save), or once ``upload`` (its future) is done."""

    name: str
    target: Path
    rank: int
    upload: Any = None

    def write(self) -> dict[str, WrittenFile | Path]:
        if self.upload is not None:
            self.upload.result()
        # The writer numbers shard files by rank, from 1.
        mine = sorted(self.target.glob(f"shard-{self.rank + 1:05d}-*.safetensors"))
        return {f"{self.name}/{path.name}": path for path in mine}
