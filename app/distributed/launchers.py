"""``notebook_launcher``: start a training function from a notebook or a REPL, as Accelerate documents
it. The hardware kind that the environment shows decides how (``HardwareSpec.detects`` and
``local_workers``, in ``app/distributed/hardware/``): forked worker processes for the multi-process
kinds, the calling process for a single device or for a kind that drives all of a host's devices
from one process.

>>> from app.distributed import Accelerator, notebook_launcher
>>> model = build_model()  # once, outside: each forked process gets its own copy
>>> def train(model):
...     accelerator = Accelerator()  # inside: sees the launcher's processes
...     model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
...     ...
>>> notebook_launcher(train, args=(model,), num_processes=2)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

MIXED_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"
"""What ``Accelerator(mixed_precision=None)`` falls back to (Accelerate's variable)."""
_PRECISIONS = ("no", "fp16", "bf16")


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` processes of this machine (``num_nodes`` machines
    in all, each calling this with its ``node_rank``), or in this process. On one machine a busy
    ``use_port`` is replaced by a free port (no other machine needs to know it).

    Processes are forked, so a model or data built before the call and passed in ``args`` reach
    every process without pickling, and ``function`` may be defined in the notebook. An
    ``Accelerator()`` created inside ``function`` picks up the process group (DDP on gloo on CPUs);
    ``mixed_precision`` becomes its default. With ``num_processes`` None or 1, or on a kind that runs
    one process per host, ``function`` runs here. A failing process stops the others and raises
    :class:`~app.workers.elastic.WorkerFailed` naming its rank and error.

    Returns what ``function`` returned on each process of this machine, in local rank order (Accelerate
    returns nothing).
    """
    if mixed_precision.lower() not in _PRECISIONS:
        raise ValueError(f"Unknown mixed_precision mode {mixed_precision!r}; choose one of {', '.join(_PRECISIONS)}.")
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank must be in [0, num_nodes), got node_rank={node_rank} with num_nodes={num_nodes}.")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be 1 or more, got {num_processes}.")
    workers = _local_workers(num_processes or 1, num_nodes)
    with _environment({MIXED_PRECISION_ENV: mixed_precision.lower()}):
        if workers == 0:
            return [function(*args)]
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        from app.workers.elastic import WorkerFailed, local_port, start_processes

        conf = dict(rdzv_conf or {})
        if rdzv_backend == "static":
            conf["rank"] = node_rank
            # On one machine the port is private to the launch: a busy one (the previous cell's
            # launch still closing, another job on 29500) is swapped for a free one. Across machines
            # the others dial use_port, so it stays as given.
            port = local_port(master_addr, int(use_port)) if num_nodes == 1 else use_port
            rdzv_endpoint = rdzv_endpoint or f"{master_addr}:{port}"
        try:
            # Fork, as Accelerate does in notebooks: the function and its arguments are not pickled.
            return start_processes(function, args, workers, start_method="fork", num_nodes=num_nodes,
                                   rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_configs=conf,
                                   run_id=rdzv_id, max_restarts=max_restarts, monitor_interval=monitor_interval)
        except WorkerFailed as failed:
            # Also a ChildFailedError, which Accelerate's notebook_launcher raises and scripts catch.
            raise type("NotebookWorkerFailed", (type(failed), ChildFailedError), {})(
                str(failed), failed.traceback) from None


def _local_workers(num_processes: int, num_nodes: int) -> int:
    """Ask the hardware kind the environment shows how many processes to fork here (0: none, run
    in this process). The same contract as ``python -m app``'s ``launch``."""
    from app.config import HardwareConfig, HardwareKind
    from app.distributed.hardware import detect_spec

    spec = detect_spec(num_processes * num_nodes, cpu=False)
    hw = HardwareConfig(kind=HardwareKind(spec.kind), num_processes=num_processes, num_nodes=num_nodes)
    return spec.local_workers(hw)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set variables for the block (forked processes inherit them), then restore the old ones."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
