"""PyTorch/XLA through SPMD: one process per host drives every XLA device of that host (TPU chips,
or XLA's CPU device with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` in the tests).

Layout. ``torch_xla.runtime.use_spmd()`` turns the host's devices into one virtual device; a 1-D
mesh named ``data`` spans all devices of all hosts. Parameters carry no sharding annotation, so XLA
replicates them; every batch is sharded along dim 0 over the mesh as it is placed on the device, so
each device computes on its slice and XLA inserts the gradient all-reduce itself. On several hosts
each process loads its own share of every global step (``process_index`` of ``process_count``) and
hands it over as that host's part of the global batch (``ShardingSpec(minibatch=True)``).

Meaning of the Accelerator API here. ``num_processes``/``process_index`` count processes (hosts),
not devices. Tensors on the device are *global*: a gathered or reduced device tensor is already
the whole batch's, so tensor collectives are identities; per-process values (objects, CPU
tensors) go through a gloo group across hosts when there is more than one.

Sharding. ``sharding=fsdp`` (PyTorch/XLA's FSDPv2) shards every parameter along its largest
dimension over the same ``data`` axis, so each device holds a slice of every weight and of its
optimizer state; XLA gathers a weight where a step needs it whole and reduce-scatters its gradient.
The module is not wrapped: its state dict, and so its checkpoints, are the unsharded run's.

Input. Prepared loaders load and place batches ``prefetch_depth`` steps ahead in a background
thread (``app/distributed/data/prefetch.py``), as torch_xla's ``MpDeviceLoader`` does, so collating and
copying the next batches overlaps the tracing and execution of the current step.

Compile cache and report. The backend points torch_xla's persistent compilation cache at a folder
(``hardware.compile_cache_dir``) before anything runs, and :meth:`XlaSpmdBackend.runtime_report`
says at the end of a run what XLA did (``app/distributed/backends/xla_metrics.py``).

Graphs. XLA traces lazily and compiles one graph per distinct shape and program; ``step_end``
(``torch_xla.sync()``) cuts the graph once per optimizer step. Nothing else in a training step
reads a device value on the host. Shapes are kept fixed by :attr:`XlaSpmdBackend.static_shapes`:
the data loaders pad their last batch to full size and tasks pad sequences to a fixed length.

This module imports ``torch_xla`` only when a backend is built, so the rest of the application
works without it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.config import ConfigError, MeshSharding
from app.distributed.backends.base import Backend
from app.distributed.backends.xla_metrics import XlaCounts
from app.distributed.hardware.xla import XLA, xla_problem
from app.distributed.operations import recursively_apply

log = logging.getLogger(__name__)


class XlaSpmdBackend(Backend):
    """All XLA devices of this host as one SPMD program; see the module docstring."""

    static_shapes = True
    prefetch_depth = 2

    def __init__(self, sharding: MeshSharding = MeshSharding.replicated, compile_cache_dir: Path | None = None) -> None:
        """``compile_cache_dir``: torch_xla's persistent compilation cache (None: none); with several
        hosts, each writes its own subfolder."""
        problem = xla_problem()
        if problem is not None:
            raise ConfigError(problem)
        import numpy as np
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        if compile_cache_dir is not None:
            use_compile_cache(compile_cache_dir)
        self._counts_at_start = XlaCounts.now()
        self.sharding = sharding
        if not xr.is_spmd():  # once per process (a second backend, as in the tests, finds it on)
            xr.use_spmd()
        super().__init__(torch_xla.device(), XLA)
        # set_seed seeded torch before the backend existed: the device's stream follows that seed.
        XLA.seed(torch.initial_seed() % 2**63)
        self.num_devices = xr.global_runtime_device_count()
        self.local_devices = xr.addressable_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(self.num_devices), (self.num_devices,), ("data",))
        self.num_processes = xr.process_count()
        self.process_index = xr.process_index()
        self._specs: dict[int, Any] = {}
        self._group_owned = False
        if self.num_processes > 1:
            self._join_host_group()

    def _join_host_group(self) -> None:
        """A gloo group over the hosts, for objects and per-process CPU values (several hosts only)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            # torch_xla's xla:// rendezvous knows the hosts of the slice; gloo carries host data.
            import torch_xla.distributed.xla_backend  # noqa: F401  (registers xla://)

            dist.init_process_group("gloo", init_method="xla://")
            self._group_owned = True

    @property
    def distributed_type(self) -> str:
        return "XLA"

    # -- data -----------------------------------------------------------------------------------------
    def place_batch(self, batch: Any, non_blocking: bool = False) -> Any:
        """Copy a host batch to the device, every tensor with a batch dimension sharded along it
        (``non_blocking`` changes nothing here: XLA's transfers are asynchronous already)."""
        import torch_xla

        def place(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0:
                return t.to(self.device)
            if t.shape[0] % self.local_devices:
                raise ConfigError(
                    f"a batch of {t.shape[0]} samples cannot be split evenly over this host's {self.local_devices} "
                    f"XLA devices; make trainer.batch_size (and trainer.eval_batch_size) a multiple of "
                    f"{self.local_devices}.")
            spec = self._sharding(t.dim())
            return torch_xla._XLAC._xla_tensors_from_aten([t], [str(self.device)], [spec.xla_spec(t)])[0]

        return recursively_apply(place, batch, error_on_other=False)

    def _sharding(self, rank: int) -> Any:
        """Dim 0 over the ``data`` axis, the other dims whole; one spec per tensor rank."""
        if rank not in self._specs:
            import torch_xla.distributed.spmd as xs

            partition = ("data",) + (None,) * (rank - 1)
            self._specs[rank] = xs.ShardingSpec(self.mesh, partition, minibatch=self.num_processes > 1)
        return self._specs[rank]

    # -- model ----------------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """On the device; replicated (no annotation: SPMD copies it to every device), or each
        parameter sharded along its largest dimension (``sharding=fsdp``)."""
        model = model.to(self.device)
        if self.sharding is MeshSharding.fsdp:
            import torch_xla.distributed.spmd as xs

            for parameter in model.parameters():
                if parameter.dim() > 0:
                    partition: list[str | None] = [None] * parameter.dim()
                    partition[max(range(parameter.dim()), key=lambda d: parameter.shape[d])] = "data"
                    xs.mark_sharding(parameter, self.mesh, tuple(partition))
            # As FSDPv2 does: a barrier per module in backward, so that XLA does not fuse the whole
            # backward into one program that holds every gathered weight at once.
            xs.xla_sharding.apply_backward_optimization_barrier(model)
        return model

    def runtime_report(self) -> str | None:
        """Graphs compiled (and in how long), loaded from the compile cache, executions, host reads
        and CPU fallback ops since this backend was built."""
        return XlaCounts.now().since(self._counts_at_start).sentence()

    # -- collectives: device tensors are global already -----------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole (global) tensor, replicated on every device and computed: gathering is how
        results reach the host (metrics), so it cuts the graph here.

        Replicated, because copying a still-sharded result to the host compiles a fresh resharding
        program at every call (measured: one per evaluation batch); cut, because a bare copy runs
        only the part of the graph it needs, and what stays pending (dropout's RNG seed, buffers)
        would change the next training step's graph (measured: two new graphs after every
        evaluation on BERT). Gather at evaluation or log points, not inside every training step."""
        if tensor.device.type != "xla":
            if self.num_processes > 1:
                return self._host_all_gather(tensor)
            return tensor.reshape(1) if tensor.dim() == 0 else tensor
        import torch_xla
        import torch_xla.distributed.spmd as xs

        is_bool = tensor.dtype is torch.bool
        # A computed copy (``clone`` of device data keeps the data's own sharding), annotated as replicated.
        whole = (tensor.to(torch.uint8) if is_bool else tensor).reshape(tensor.shape or (1,)) + 0
        xs.mark_sharding(whole, self.mesh, (None,) * whole.dim())
        torch_xla.sync()
        return whole.bool() if is_bool else whole

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if op not in ("sum", "mean", "max", "min"):
            raise ValueError(f"reduction must be one of ['max', 'mean', 'min', 'sum'], got {op!r}.")
        if tensor.device.type != "xla" and self.num_processes > 1:
            return self._host_all_reduce(tensor, op)
        return tensor.clone()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.num_processes == 1:
            return [obj]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.num_processes
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int) -> Any:
        if self.num_processes == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.num_processes > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("app-barrier")

    def _host_all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self.all_gather_object(tensor.reshape(1) if tensor.dim() == 0 else tensor)
        return torch.cat(parts)

    def _host_all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        stacked = torch.stack(self.all_gather_object(tensor.detach()))
        if op == "mean":  # integers become floats, as with DDP
            return stacked.sum(dim=0) / self.num_processes
        if op == "sum":
            return stacked.sum(dim=0)
        return stacked.amax(dim=0) if op == "max" else stacked.amin(dim=0)

    def shutdown(self) -> None:
        if self._group_owned:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._group_owned = False


def use_compile_cache(folder: Path) -> None:
    """Point torch_xla's persistent compilation cache at ``folder`` (a subfolder per host when there
    are several), unless this process has compiled already: the cache is chosen once, before the
    first graph (a second backend in one process, as in the tests, keeps the first one's)."""
    import torch_xla
    import torch_xla.runtime as xr

    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        log.debug("XLA's compile cache is already chosen in this process; %s is not used", folder)
        return
    if xr.process_count() > 1:
        folder = folder / f"process_{xr.process_index()}"
    folder.mkdir(parents=True, exist_ok=True)
    xr.initialize_cache(str(folder), readonly=False)
