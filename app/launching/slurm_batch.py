"""``hydra/launcher=slurm``: its options (:class:`SlurmLauncherConfig`, the schema of
``conf/hydra/launcher/slurm.yaml``) and the batch script it submits for each job of a sweep.

The script is the README's plain ``sbatch`` script: ``srun python -m app <the job's overrides>
hydra.run.dir=<its folder>``, one SLURM task per training process, so every task is one rank
(``app.launching.slurm``) and the job writes one run folder. With ``timeout_min`` SLURM sends SIGUSR1
``signal_delay_s`` before the limit: the run saves at the step and the job requeues itself, up to
``max_num_timeout`` times (``app.launching.slurm_requeue``); a requeued job continues by itself
(``resume=auto``). Torch-free and Hydra-free.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from app.launching.overrides import quote
from app.launching.slurm_requeue import MAX_NUM_TIMEOUT_ENV

GPU_KINDS = ("gpu", "multi_gpu", "fsdp")
"""The ``hardware=`` kinds that ask for GPUs when ``gpus_per_node`` is null."""


@dataclass
class SlurmLauncherConfig:
    """``hydra.launcher`` with ``hydra/launcher=slurm``; each field is an ``sbatch`` option."""

    _target_: str = "hydra_plugins.app_launchers.SlurmLauncher"
    partition: str | None = None
    """``--partition``; null: the cluster's default partition."""
    nodes: int | None = None
    """``--nodes``; null: the job's ``hardware.num_nodes``."""
    tasks_per_node: int | None = None
    """``--ntasks-per-node``, one task per training process; null: the job's ``hardware.num_processes``."""
    gpus_per_node: int | None = None
    """``--gpus-per-node``; null: one per task for hardware=gpu/multi_gpu/fsdp, none otherwise."""
    cpus_per_task: int = 8
    """``--cpus-per-task``: data loading and the process's own threads (its OMP_NUM_THREADS)."""
    mem_gb: float | None = 64
    """``--mem`` per node, in GB; null: the partition's default."""
    timeout_min: int | None = 240
    """``--time`` in minutes; null: the partition's limit."""
    signal_delay_s: int = 120
    """``--signal=USR1@<s>``: how long before the time limit the run is told to save."""
    max_num_timeout: int = 3
    """How often a job requeues itself on that warning; past it, the job ends with its checkpoint."""
    requeue: bool = True
    """``--requeue``: SLURM may requeue the job (preemption, ``scontrol requeue``, the warning above)."""
    job_name: str = "app"
    """``--job-name``; each job's number is appended."""
    sbatch_args: list[str] = field(default_factory=list)
    """More ``sbatch`` options, each one ``--name=value`` (``--account=x``, ``--qos=y``, ``--overcommit``)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the script runs before ``srun`` (``module load ...``, ``source .venv/bin/activate``)."""
    python: str | None = None
    """The interpreter the tasks run; null: the one running the sweep."""
    folder: str = "${hydra.sweep.dir}/.slurm"
    """Where each job's script and output go (``<number>_<SLURM job id>.out`` / ``.err``)."""
    poll_s: float = 5.0
    """How often the sweep asks ``squeue`` about its jobs (never ``sacct``: accounting may be off)."""


@dataclass
class BatchJob:
    """One job of a sweep as SLURM runs it."""

    number: int
    run_dir: Path
    overrides: list[str]
    """The job's task overrides (Hydra's, as the sweeper made them), then the sweep's Hydra ones."""
    nodes: int
    tasks_per_node: int
    gpus_per_node: int


def job_layout(options: SlurmLauncherConfig, kind: str, num_processes: int, num_nodes: int) -> tuple[int, int, int]:
    """(nodes, tasks per node, GPUs per node) for a job with this ``hardware`` config."""
    tasks = options.tasks_per_node if options.tasks_per_node is not None else num_processes
    gpus = options.gpus_per_node if options.gpus_per_node is not None else (tasks if kind in GPU_KINDS else 0)
    return (options.nodes if options.nodes is not None else num_nodes), tasks, gpus


def sbatch_options(options: SlurmLauncherConfig, job: BatchJob, log_folder: Path) -> list[str]:
    stem = log_folder / f"{job.number}_%j"
    lines = [f"--job-name={options.job_name}-{job.number}", f"--output={stem}.out", f"--error={stem}.err",
             # A requeued job appends to the output of its earlier runs instead of replacing it.
             "--open-mode=append",
             f"--nodes={job.nodes}", f"--ntasks-per-node={job.tasks_per_node}",
             f"--cpus-per-task={options.cpus_per_task}",
             "--requeue" if options.requeue else "--no-requeue"]
    if job.gpus_per_node:
        lines.append(f"--gpus-per-node={job.gpus_per_node}")
    if options.mem_gb is not None:
        lines.append(f"--mem={max(1, round(options.mem_gb * 1024))}M")
    if options.timeout_min is not None:
        lines += [f"--time={options.timeout_min}", f"--signal=USR1@{options.signal_delay_s}"]
    if options.partition:
        lines.append(f"--partition={options.partition}")
    return lines + list(options.sbatch_args)


def batch_script(options: SlurmLauncherConfig, job: BatchJob, python: str, cwd: Path, log_folder: Path) -> str:
    """The ``sbatch`` script of one job."""
    # Its number as a sweep's job has it (the sweep report reads it; ${hydra.job.num} resolves alike).
    command = [python, "-m", "app", *job.overrides, f"hydra.job.num={job.number}", f"hydra.run.dir={quote(str(job.run_dir))}"]
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {shlex.quote(line)}" for line in sbatch_options(options, job, log_folder)),
        f"# job {job.number} of the sweep; its run folder: {job.run_dir}",
        f"export {MAX_NUM_TIMEOUT_ENV}={options.max_num_timeout}",
        "export PYTHONUNBUFFERED=1",
        f"cd {shlex.quote(str(cwd))}",
        *options.setup,
        # One task per rank, each line labelled with its task; one failing task ends the others.
        "srun --label --kill-on-bad-exit=1 " + " ".join(shlex.quote(part) for part in command),
        "",
    ])
