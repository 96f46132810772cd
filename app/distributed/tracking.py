"""Experiment trackers behind one small interface: ``log(values, step)`` and ``finish()``.

Only the main process creates trackers, so every event is written once.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from app.run_layout import metrics_file, tensorboard_dir


class Tracker:
    name = "base"
    tracker: Any = None

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``; ``kwargs``: arguments of this tracker's own log call
        (``Accelerator.log(log_kwargs={name: ...})``), refused by a tracker that has none."""
        raise NotImplementedError

    def refuse(self, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(f"log_kwargs for the {self.name} tracker: it takes no arguments ({', '.join(kwargs)}); "
                             f"remove log_kwargs[{self.name!r}].")

    def finish(self) -> None:
        pass


class JsonlTracker(Tracker):
    """One JSON object per line and event; appends, so a resumed run continues the same file."""

    name = "jsonl"

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tracker = path.open("a", encoding="utf-8")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if kwargs:
            self.refuse(kwargs)
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        self.tracker.write(json.dumps(record) + "\n")
        self.tracker.flush()

    def finish(self) -> None:
        self.tracker.close()


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, logging_dir: Path, project_name: str, config: dict[str, Any],
                 init_kwargs: dict[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # init_kwargs={"purge_step": N} (a resumed run) hides events at steps >= N that the
        # interrupted run wrote after its last checkpoint.
        self.tracker = SummaryWriter(log_dir=str(tensorboard_dir(logging_dir)), **(init_kwargs or {}))
        if config:
            self.tracker.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``kwargs``: ``SummaryWriter.add_scalar``'s (``walltime``, ``new_style``, ``double_precision``)."""
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tracker.add_scalar(key, value, global_step=step, **kwargs)
        self.tracker.flush()

    def finish(self) -> None:
        self.tracker.close()


class WandbTracker(Tracker):
    """Weights & Biases, offline unless the user configured an online mode or an API key."""

    name = "wandb"

    def __init__(self, logging_dir: Path, project_name: str, config: dict[str, Any], init_kwargs: dict[str, Any]):
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("logging.trackers has wandb, but the wandb package is not installed; "
                               "pip install wandb, or remove it from logging.trackers.") from err
        if "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ:
            init_kwargs = {"mode": "offline", **init_kwargs}
        self.tracker = wandb.init(project=project_name, dir=str(logging_dir), config=config, **init_kwargs)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.tracker.log(values, step=step, **kwargs)  # wandb.log's commit, sync

    def finish(self) -> None:
        self.tracker.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the line parseable
    return value


def build_trackers(names: list[str], project_name: str, logging_dir: Path, config: dict[str, Any],
                   init_kwargs: dict[str, Any]) -> list[Tracker]:
    trackers: list[Tracker] = []
    for name in names:
        if name == "jsonl":
            trackers.append(JsonlTracker(metrics_file(logging_dir)))
        elif name == "tensorboard":
            trackers.append(TensorBoardTracker(logging_dir, project_name, config, init_kwargs.get("tensorboard")))
        elif name == "wandb":
            trackers.append(WandbTracker(logging_dir, project_name, config, init_kwargs.get("wandb", {})))
        else:
            raise ValueError(f"unknown tracker {name!r}; expected jsonl, tensorboard or wandb.")
    return trackers
