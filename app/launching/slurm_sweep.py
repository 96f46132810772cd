"""``hydra/launcher=slurm``: a sweep's jobs submitted with ``sbatch``, followed with ``squeue``, their
results read from their run folders.

- Each job is one batch script (``app.launching.slurm_batch``) in ``<sweep>/.slurm/``; its output goes
  next to it (``<number>_<SLURM job id>.out`` / ``.err``, each line labelled with its task).
- The sweep asks ``squeue --states=all`` about its jobs every ``poll_s`` seconds. Never ``sacct``:
  many clusters run without accounting, where it fails at every call. A job that is pending, running
  or requeued (preemption, ``scontrol requeue``, its own time-limit requeue) is waited for; a job that
  left the queue has ended.
- A job ended well when its run folder's ``result.json`` says so (finished, or nan: a trial that
  diverged); its objective is the job's return value. Any other end is a failed job, whose sentence is
  the one its tasks said (the failing rank's ``error: ...`` first, a peer that only lost it last; or
  the ``interrupted ... resume with ...`` line of a job stopped for good) or else SLURM's state. The
  sweeper decides what a failed job means (the grid sweep stops with that sentence, exit 1).

Interrupted while waiting (Ctrl-C), the sweep ends and says which jobs keep running on the cluster.
"""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import CompactHydraException
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf, open_dict

from app.engine.result import FINISHED, NAN, read_result
from app.interrupts import Interrupted
from app.launching.overrides import override_key
from app.launching.slurm_batch import BatchJob, SlurmLauncherConfig, batch_script, job_layout
from app.workers.elastic import is_peer_loss

log = logging.getLogger(__name__)

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "DEADLINE", "BOOT_FAIL", "REVOKED"}
"""Final states: the job will not run again."""
ENDED_UNLESS_REQUEUED = {"PREEMPTED", "NODE_FAIL"}
"""Final only if the job is not requeued next (a job with --requeue is): believed on a second look."""
GONE = "GONE"
"""No longer known to squeue (ended more than MinJobAge ago)."""

# Hydra settings of the sweep that are the sweep's own, not its jobs'.
_SWEEP_ONLY = ("hydra.launcher", "hydra/launcher", "hydra.sweeper", "hydra/sweeper", "hydra.sweep",
               "hydra.callbacks", "hydra.mode", "hydra.run")
_LABEL = re.compile(r"^\s*\d+: ")
_INTERRUPTED = re.compile(r"interrupted \(SIG\w+\) .*")
_SLURM_SAYS = re.compile(r"error: (\*\*\* .* \*\*\*)")


class SlurmLaunchError(RuntimeError):
    """The jobs cannot be submitted (no SLURM here, or sbatch refused one); the message says why."""


class SlurmJobFailed(CompactHydraException):
    """A job of the sweep did not finish; the message is one sentence."""


@dataclass
class Submitted:
    job: BatchJob
    job_id: str
    output: Path
    """The job's output files, without their suffix (``.out`` / ``.err``)."""
    state: str = "PENDING"
    ended_unless_requeued: bool = False


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
    except FileNotFoundError:
        raise SlurmLaunchError(f"hydra/launcher=slurm needs SLURM's {command[0]}, which is not on PATH: run the "
                               "sweep on a machine of the cluster (a login node).") from None


def submit(script: Path) -> str:
    """``sbatch`` the script; returns the SLURM job id."""
    done = _run(["sbatch", "--parsable", str(script)])
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()[-1]
        raise SlurmLaunchError(f"sbatch refused {script}: {said.removeprefix('sbatch: error: ')}.")
    return done.stdout.strip().split(";")[0]


class QueueUnavailable(RuntimeError):
    """squeue did not answer (the controller is busy or restarting): ask again later."""


def queue_states(job_ids: Sequence[str]) -> dict[str, str]:
    """Each job's state as squeue shows it (ended jobs too, for MinJobAge); a job it no longer knows is
    absent. Raises QueueUnavailable when squeue fails."""
    done = _run(["squeue", "--noheader", "--states=all", "--format=%i|%T", f"--jobs={','.join(job_ids)}"])
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return {}  # every one of them ended long enough ago
        raise QueueUnavailable(done.stderr.strip() or f"exit code {done.returncode}")
    states = {}
    for line in done.stdout.splitlines():
        job_id, _, state = line.strip().partition("|")
        states[job_id] = state.split()[0] if state else "UNKNOWN"
    return states


class SlurmSweep:
    """One ``launch`` of a sweep's jobs on SLURM."""

    def __init__(self, options: SlurmLauncherConfig, config: DictConfig, hydra_context: HydraContext):
        self.options = options
        self.config = config
        self.hydra_context = hydra_context
        self.cwd = Path(str(config.hydra.runtime.cwd))
        self.sweep_dir = self.cwd / str(config.hydra.sweep.dir)
        self.log_folder = self.cwd / options.folder
        self.python = options.python or sys.executable

    def batch_job(self, number: int, overrides: Sequence[str]) -> BatchJob:
        job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.num = number
        run_dir = self.sweep_dir / str(OmegaConf.select(job_cfg, "hydra.sweep.subdir"))
        hw = job_cfg.hardware
        kind = getattr(hw.kind, "value", hw.kind)  # an Enum in the typed config
        nodes, tasks, gpus = job_layout(self.options, str(kind), int(hw.num_processes), int(hw.num_nodes))
        hydra_overrides = [o for o in self.config.hydra.overrides.hydra
                           if not override_key(o).startswith(_SWEEP_ONLY)]
        return BatchJob(number, run_dir, [*overrides, *hydra_overrides], nodes, tasks, gpus)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
        self.log_folder.mkdir(parents=True, exist_ok=True)
        submitted: list[Submitted] = []
        try:
            for offset, overrides in enumerate(job_overrides):
                job = self.batch_job(initial_job_idx + offset, overrides)
                script = self.log_folder / f"{job.number}.sbatch"
                script.write_text(batch_script(self.options, job, self.python, self.cwd, self.log_folder))
                job_id = submit(script)
                submitted.append(Submitted(job, job_id, self.log_folder / f"{job.number}_{job_id}"))
                log.info("job %d: SLURM job %s (%s), run folder %s", job.number, job_id, " ".join(overrides),
                         job.run_dir)
        except SlurmLaunchError as err:
            # Bad input, as a refused config is: one sentence, exit 2, nothing left running.
            cancel([s.job_id for s in submitted])
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        self.wait(submitted)
        return [job_return(s) for s in submitted]

    def wait(self, submitted: list[Submitted]) -> None:
        """Until every job has ended."""
        waiting = {s.job_id: s for s in submitted}
        unanswered: str | None = None
        try:
            while waiting:
                try:
                    states = queue_states(list(waiting))
                except QueueUnavailable as err:
                    if unanswered is None:  # said once, not at every poll
                        log.warning("squeue does not answer (%s); asking again every %s s", err, self.options.poll_s)
                    unanswered, states = str(err), None
                else:
                    if unanswered is not None:
                        log.info("squeue answers again")
                    unanswered = None
                if states is not None:
                    for job_id, sub in list(waiting.items()):
                        if self.has_ended(sub, states.get(job_id, GONE)):
                            del waiting[job_id]
                            ended = job_return(sub)
                            if ended.status is JobStatus.FAILED:
                                log.error("%s", ended._return_value)
                if waiting:
                    time.sleep(self.options.poll_s)
        except Interrupted as stopped:
            ids = " ".join(waiting)
            stopped.stage = f"while waiting for SLURM jobs {ids}; they keep running (scancel {ids} stops them)"
            raise

    def has_ended(self, sub: Submitted, state: str) -> bool:
        if state != sub.state:
            log.info("job %d (SLURM job %s): %s", sub.job.number, sub.job_id, state.lower())
        previous, sub.state = sub.state, state
        if state in ENDED or state == GONE:
            return True
        if state in ENDED_UNLESS_REQUEUED:
            seen_twice = previous == state and sub.ended_unless_requeued
            sub.ended_unless_requeued = True
            return seen_twice
        sub.ended_unless_requeued = False
        return False


def cancel(job_ids: Sequence[str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, check=False, timeout=120)


def job_return(sub: Submitted) -> JobReturn:
    """The job's result: its objective when its run folder says it finished, else the failure."""
    ret = JobReturn(overrides=list(sub.job.overrides), working_dir=str(sub.job.run_dir), task_name="app")
    result = read_result(sub.job.run_dir) or {}
    if result.get("status") in (FINISHED, NAN):
        value = result.get("objective")
        ret.status = JobStatus.COMPLETED
        ret.return_value = float(value) if isinstance(value, (int, float)) else math.nan
        return ret
    ret.status = JobStatus.FAILED
    ret.return_value = SlurmJobFailed(
        f"job {sub.job.number} (SLURM job {sub.job_id}) {sub.state.lower()}: "
        f"{failure_sentence(sub.output)} (its output: {sub.output}.err)")
    return ret


def failure_sentence(output: Path) -> str:
    """What the job's tasks said about its end: the first ``error:`` sentence of a task that failed by
    itself (a peer that only lost it comes last), else the last ``interrupted ...`` line, else what
    SLURM wrote (``*** JOB ... CANCELLED ... DUE TO TIME LIMIT ***``)."""
    lines = []
    for suffix in (".err", ".out"):
        try:
            text = output.with_suffix(suffix).read_text(errors="replace")
        except OSError:
            continue
        lines += [_LABEL.sub("", line).strip() for line in text.splitlines()]
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if errors:
        return min(errors, key=is_peer_loss)  # the first that is not a peer loss, if any
    interrupted = [m.group(0) for line in lines if (m := _INTERRUPTED.search(line))]
    if interrupted:
        return interrupted[-1]
    slurm = [m.group(1) for line in lines if (m := _SLURM_SAYS.search(line))]
    return slurm[-1] if slurm else "it ended without saying why"
