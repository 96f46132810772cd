"""What this process is: the one place that reads it from the environment and the command line.

- **Its place in a launched job**: torchrun, torch's elastic launcher (``hardware=multi_cpu``'s workers)
  and a SLURM step (``app.launching.slurm`` exports the same variables) say it in ``RANK``,
  ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; a plain ``python -m app`` has none of them and is rank 0 of 1.
- **Whether its command line asks for a sweep** (Hydra's ``-m`` / ``--multirun``).
- **The CPU cores it may run on**: what caps the CPU processes of a run, the parallel jobs of a sweep and
  each worker's threads.

Torch-free, and imports nothing from ``app``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE = "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"
"""The launcher's variables (torchrun's names); an empty one counts as unset."""
MULTIRUN_FLAGS = ("-m", "--multirun")


def launched_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's rank when a launcher started it (``RANK`` is set); None for a plain ``python -m app``."""
    value = environ.get(RANK)
    return int(value) if value else None


def rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank in its job: 0 outside a launched one."""
    return int(environ.get(RANK) or 0)


def is_rank_zero(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is the job's first (the one that writes the run folder and says what happens)."""
    return rank(environ) == 0


def launched_world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """The number of processes when this one was started by torchrun (or another launcher that sets
    RANK and WORLD_SIZE); None for a plain ``python -m app``."""
    if environ.get(RANK) and environ.get(WORLD_SIZE):
        return int(environ[WORLD_SIZE])
    return None


def world_size(environ: Mapping[str, str] = os.environ) -> int:
    """The processes of this job: 1 outside a launched one."""
    return int(environ.get(WORLD_SIZE) or 1)


def local_rank(default: int = 0, environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank among the job's processes on this machine (``LOCAL_RANK``), ``default`` when unset."""
    return int(environ.get(LOCAL_RANK) or default)


def local_world_size(default: int = 1, environ: Mapping[str, str] = os.environ) -> int:
    """The processes of this job on this machine (``LOCAL_WORLD_SIZE``), ``default`` when unset."""
    return int(environ.get(LOCAL_WORLD_SIZE) or default)


def is_multirun(argv: Sequence[str]) -> bool:
    """Whether the command line (without the program) asks Hydra for a multirun: ``-m`` or ``--multirun``."""
    return any(arg in MULTIRUN_FLAGS for arg in argv)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
