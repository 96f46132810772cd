"""How a pruned sweep's jobs find their study and trial, whichever launcher runs them.

The sweeper exports :data:`STUDY_ENV` (the storage URL, study name and pruner settings, the same for
every job of the sweep) before it launches anything, so every process it starts inherits it: joblib's
and submitit's workers, SLURM jobs (sbatch passes the environment on), the fork server that starts a
job's training processes. Which trial a job is, the environment cannot say (a parallel launcher
starts its workers once for several jobs): the sweeper records each trial's job folder in the study
(user attribute :data:`FOLDER_ATTR`) when it launches it, and the job looks its folder up there
(``app.sweeps.trial_pruning``). Torch- and optuna-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from app.sweeps.optuna_config import PrunerName

STUDY_ENV = "APP_OPTUNA_STUDY"
FOLDER_ATTR = "run_folder"
"""The trial's job folder (absolute), set by the sweeper."""
PRUNED_ATTR = "pruned_at_step"
"""The optimizer step at which the job pruned its trial, set by the job (the dashboard shows it)."""


class StudyLinkError(RuntimeError):
    """:data:`STUDY_ENV` holds something else than a sweeper wrote; the message says what."""


@dataclass(frozen=True)
class StudyLink:
    storage: str
    study_name: str
    pruner: PrunerName
    warmup_evaluations: int
    startup_trials: int

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "pruner": self.pruner.value})

    @staticmethod
    def from_json(text: str) -> StudyLink:
        try:
            fields = json.loads(text)
            link = StudyLink(storage=str(fields["storage"]), study_name=str(fields["study_name"]),
                             pruner=PrunerName(fields["pruner"]), warmup_evaluations=int(fields["warmup_evaluations"]),
                             startup_trials=int(fields["startup_trials"]))
        except (ValueError, TypeError, KeyError) as err:
            raise StudyLinkError(f"{STUDY_ENV}={text!r} is not what the Optuna sweeper writes ({err}); unset it.") from None
        if link.warmup_evaluations < 0 or link.startup_trials < 0:
            raise StudyLinkError(f"{STUDY_ENV}={text!r} has a negative warm-up or start-up count; unset it.")
        return link

    @staticmethod
    def from_env(environ: MutableMapping[str, str] = os.environ) -> StudyLink | None:
        """The sweep's study, or None outside a sweep that prunes."""
        text = environ.get(STUDY_ENV)
        return StudyLink.from_json(text) if text else None


@contextmanager
def exported(link: StudyLink | None, environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """:data:`STUDY_ENV` set to ``link`` (removed for None) for the sweep's duration, then as it was."""
    before = environ.get(STUDY_ENV)
    if link is None:
        environ.pop(STUDY_ENV, None)
    else:
        environ[STUDY_ENV] = link.to_json()
    try:
        yield
    finally:
        if before is None:
            environ.pop(STUDY_ENV, None)
        else:
            environ[STUDY_ENV] = before


def folder_key(folder: Path | str) -> str:
    """A job folder as the sweeper records it and the job compares it: absolute, symbolic links kept
    (both sides see the same path; resolving could differ between machines of a cluster)."""
    return os.path.abspath(os.fspath(folder))
