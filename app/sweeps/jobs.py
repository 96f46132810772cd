"""Launch numbered jobs through any Hydra launcher, leaving out the finished jobs of a resumed sweep.

With ``resume=auto`` among a job's overrides and a folder where that job already finished
(``result.json`` says finished, pruned or nan), the job is not launched again: its result is read back from
the folder, which stays as it was (Hydra would rewrite ``.hydra/`` and append to the log). Every
other job is launched: an interrupted one continues from its newest valid checkpoint
(``resume=auto``), a missing one starts. Jobs keep their numbers, hence their folders.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf, open_dict

from app.engine.result import FINISHED, NAN, PRUNED, read_result
from app.launching.overrides import override_key

log = logging.getLogger(__name__)


class SweepResumeError(RuntimeError):
    """The sweep folder holds other jobs than this command's; the message says what to do."""


def _comparable(overrides: Sequence[str]) -> list[str]:
    return sorted(o for o in overrides if override_key(o) != "resume")


def resumes(overrides: Sequence[str]) -> bool:
    """Whether the job's overrides say resume=auto (quoted or not)."""
    values = [o.split("=", 1)[1].strip("'\"") for o in overrides if override_key(o) == "resume" and "=" in o]
    return bool(values) and values[-1] == "auto"


class NumberedJobs:
    """Runs ``(job number, overrides)`` pairs on a Hydra launcher."""

    def __init__(self, launcher: Launcher, config: DictConfig, hydra_context: HydraContext):
        self.launcher = launcher
        self.config = config
        self.hydra_context = hydra_context

    def job_folder(self, number: int, overrides: Sequence[str]) -> Path:
        """Where the launcher will run this job (``hydra.sweep.dir``/``hydra.sweep.subdir``)."""
        raw = OmegaConf.to_container(self.config.hydra.sweep, resolve=False)
        if isinstance(raw, dict) and raw.get("subdir") == "${hydra.job.num}":
            return Path(str(self.config.hydra.sweep.dir)) / str(number)  # Hydra's default, without composing the job
        job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.num = number
            job_cfg.hydra.job.id = f"job_id_for_{number}"
        return Path(str(job_cfg.hydra.sweep.dir)) / str(OmegaConf.select(job_cfg, "hydra.sweep.subdir"))

    def check(self, number: int, overrides: Sequence[str]) -> Path:
        """The job's folder; raises SweepResumeError when another job made it (resuming it would
        continue that job's checkpoints with this job's settings)."""
        from app.run_folder.record import original_overrides

        folder = self.job_folder(number, overrides)
        recorded = original_overrides(folder)
        if recorded and _comparable(recorded) != _comparable(overrides):
            raise SweepResumeError(
                f"job {number}'s folder {folder} was made by other overrides ({' '.join(recorded)}) than this "
                f"sweep's ({' '.join(overrides)}); resume with the original command, or use a new hydra.sweep.dir."
            )
        return folder

    def finished(self, number: int, overrides: Sequence[str]) -> JobReturn | None:
        """The read-back result of a job this resumed sweep finished before; None: launch it."""
        if not resumes(overrides):
            return None
        folder = self.check(number, overrides)
        result = read_result(folder)
        if result is None or result.get("status") not in (FINISHED, NAN, PRUNED):
            return None
        value = result.get("objective")
        log.info("job %d already %s in %s (%s = %s): not run again", number, result["status"], folder,
                 result.get("monitor"), value)
        ret = JobReturn(overrides=list(overrides), working_dir=str(folder), task_name="app",
                        status=JobStatus.COMPLETED)
        ret.return_value = float(value) if isinstance(value, (int, float)) else math.nan
        return ret

    def launch(self, jobs: Sequence[tuple[int, Sequence[str]]]) -> list[JobReturn]:
        """Run the jobs (each run of consecutive numbers in one launch, so a parallel launcher runs
        them together); returns their results in the order given."""
        results: dict[int, JobReturn] = {}
        pending: list[tuple[int, Sequence[str]]] = []
        for number, overrides in jobs:
            done = self.finished(number, overrides)
            if done is not None:
                results[number] = done
            else:
                pending.append((number, overrides))
        for group in _consecutive(pending):
            returns = self.launcher.launch([list(o) for _, o in group], initial_job_idx=group[0][0])
            results.update(zip((n for n, _ in group), returns))
        return [results[number] for number, _ in jobs]


def _consecutive(jobs: list[tuple[int, Sequence[str]]]) -> list[list[tuple[int, Sequence[str]]]]:
    groups: list[list[tuple[int, Sequence[str]]]] = []
    for job in sorted(jobs, key=lambda j: j[0]):
        if groups and groups[-1][-1][0] + 1 == job[0]:
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups


class SkipFinishedLauncher(Launcher):
    """A Hydra launcher around another that leaves out the finished jobs of a resumed sweep."""

    def __init__(self, launcher: Launcher, config: DictConfig, hydra_context: HydraContext):
        self.jobs = NumberedJobs(launcher, config, hydra_context)

    def setup(self, **kwargs: Any) -> None:  # the wrapped launcher is set up already
        pass

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        return self.jobs.launch([(initial_job_idx + i, o) for i, o in enumerate(job_overrides)])
