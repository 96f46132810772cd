"""A SLURM job stopped by a signal: whether it requeues itself.

- **SIGUSR1** is SLURM's warning before the end: the time limit (``sbatch --signal=USR1@<s>``, which
  ``hydra/launcher=slurm`` passes: ``signal_delay_s``), or a user's ``scancel --signal=USR1``. The run has
  saved its checkpoint at the step; then the job's first task requeues the job (``scontrol requeue
  $SLURM_JOB_ID``, as Lightning does) and SLURM starts it again, where it continues from that checkpoint
  (``resume=auto``). At most ``APP_SLURM_MAX_NUM_TIMEOUT`` times per job (``hydra.launcher.max_num_timeout``;
  3 if unset); past that the job ends, its checkpoint in place, with the resume command.
- **SIGTERM** comes from SLURM itself: ``scancel`` (the user wants the job gone), ``scontrol requeue`` or a
  preemption (SLURM requeues the job itself). The run saves and exits; it never requeues itself.

Only the first task (rank 0) requeues, once the run has stopped (its checkpoint is complete); from
then on it ignores SLURM's SIGTERM, which ends the rest of the job. The requeues are counted in
``<run folder>/.slurm_requeues`` (job id and count), which outlives the job's restarts.

Torch-free; nothing here runs outside SLURM.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from app import this_process

log = logging.getLogger(__name__)

MAX_NUM_TIMEOUT_ENV = "APP_SLURM_MAX_NUM_TIMEOUT"
DEFAULT_MAX_NUM_TIMEOUT = 3
REQUEUES_FILE = ".slurm_requeues"
WARNING_SIGNAL = signal.SIGUSR1


def first_task(environ: Mapping[str, str]) -> bool:
    """Whether this process is the job's rank 0 (or its only task)."""
    rank = this_process.launched_rank(environ)
    return (rank if rank is not None else int(environ.get("SLURM_PROCID") or 0)) == 0


def requeues_so_far(run_dir: Path, job_id: str) -> int:
    """How often this job requeued itself (the file counts for one job id; another job starts at 0)."""
    try:
        recorded_job, count = (run_dir / REQUEUES_FILE).read_text().split()
    except (OSError, ValueError):
        return 0
    return int(count) if recorded_job == job_id and count.isdigit() else 0


def requeue_after_stop(signum: int, run_dir: Path, environ: Mapping[str, str] = os.environ) -> bool:
    """After a run stopped on ``signum``: requeue this SLURM job when that is the warning signal, this
    is its first task and the job has requeues left. Returns whether it was requeued."""
    job_id = environ.get("SLURM_JOB_ID")
    if signum != WARNING_SIGNAL or not job_id or not first_task(environ):
        return False
    limit = int(environ.get(MAX_NUM_TIMEOUT_ENV) or DEFAULT_MAX_NUM_TIMEOUT)
    done = requeues_so_far(run_dir, job_id)
    if done >= limit:
        log.warning("SLURM job %s is not requeued again: it requeued itself %d time(s), the limit "
                    "(%s=%d, hydra.launcher.max_num_timeout); its newest checkpoint stays in place", job_id, done,
                    MAX_NUM_TIMEOUT_ENV, limit)
        return False
    # SLURM now ends the job's processes with SIGTERM, this one included: it has nothing left to do
    # but exit.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        said = getattr(err, "stderr", None) or err
        log.warning("SLURM job %s could not be requeued (%s); was it submitted with --requeue? Its newest "
                    "checkpoint stays in place", job_id, str(said).strip())
        return False
    (run_dir / REQUEUES_FILE).write_text(f"{job_id} {done + 1}\n")
    log.info("SLURM job %s requeued itself (%d of %d): when SLURM starts it again, it continues from its newest "
             "checkpoint", job_id, done + 1, limit)
    return True
