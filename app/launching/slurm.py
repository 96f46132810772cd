"""A job that SLURM started as several tasks (``srun``, or ``hydra/launcher=slurm`` with one task per
process): each task is one rank, its layout read from SLURM's variables and exported the way torchrun
would, so the rest of the app treats it as a torchrun rank (one run folder, rank 0 writes it).

- RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), LOCAL_RANK =
  SLURM_LOCALID, LOCAL_WORLD_SIZE = the tasks on this node (SLURM_STEP_TASKS_PER_NODE,
  SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE; its first number: "4(x2)" -> 4), GROUP_RANK =
  SLURM_NODEID;
- MASTER_ADDR = the first host of the step's node list ("gpu[07-09,12]" -> gpu07), MASTER_PORT =
  a port derived from SLURM_JOB_ID (every task computes the same one), unless already set.

Only inside a step that srun started (SLURM_STEP_NUM_TASKS is set): a batch script also sees
SLURM_PROCID=0 and SLURM_NTASKS, but it is one process, which must start its workers itself.

Each task also gets ``OMP_NUM_THREADS`` = its CPUs (SLURM_CPUS_PER_TASK, else 1) unless it is set, as
torchrun does: tasks sharing a node must not each start a thread per core.

A job SLURM requeued (preemption, ``scontrol requeue``, or the job itself on the time-limit warning:
``app.launching.slurm_requeue``) continues from its newest valid checkpoint: SLURM_RESTART_COUNT > 0
turns ``resume: null`` into ``resume=auto``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

from app import this_process

_FIRST_NUMBER = re.compile(r"\d+")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``a[07-09,12],b3`` -> ``a07``; ``n1,n2`` -> ``n1``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}.")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_layout(environ: Mapping[str, str]) -> dict[str, str] | None:
    """torch.distributed's variables for this SLURM task; None outside an srun step of 2+ tasks."""
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    ntasks = int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or 1)
    if ntasks < 2:
        return None
    per_node_text = next((environ[k] for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                                               "SLURM_TASKS_PER_NODE") if environ.get(k)), str(ntasks))
    per_node = _FIRST_NUMBER.search(per_node_text)
    nodelist = next((environ[k] for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                     if environ.get(k)), "localhost")
    port = environ.get("MASTER_PORT") or str(20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000)
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": str(ntasks),
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": per_node.group(0) if per_node else str(ntasks),
        "GROUP_RANK": environ.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": port,
    }


def adopt_slurm_layout(environ: MutableMapping[str, str] = os.environ) -> None:
    """In a SLURM step of several tasks (and not already under torchrun), export this task's rank and
    master the way torchrun would: each task is one rank of the job."""
    layout = slurm_layout(environ)
    if layout is not None and this_process.launched_rank(environ) is None:
        environ.update(layout)
        environ.setdefault("OMP_NUM_THREADS", task_threads(environ))


def srun_rank(environ: Mapping[str, str]) -> bool:
    """Whether this process is one rank of a job whose ranks srun started itself (no torchrun agent
    between them: no launcher collects their errors, each says its own)."""
    return slurm_layout(environ) is not None and "TORCHELASTIC_RUN_ID" not in environ


def task_threads(environ: Mapping[str, str]) -> str:
    """OMP_NUM_THREADS for a task: the CPUs SLURM gave it (one by default)."""
    return environ.get("SLURM_CPUS_PER_TASK") or "1"


def requeued(environ: Mapping[str, str]) -> bool:
    """Whether SLURM started this job again (after a preemption or a time limit)."""
    return int(environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
