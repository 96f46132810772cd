"""``TabularTask``: the Task protocol of ``app/tasks/base.py``, implemented outside the app.

The app's engine does everything else: devices and processes, precision, the loop, evaluation
across processes, checkpoints and exact resume, the export, sweeps and ``mode=eval``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from app.config import ConfigError
from app.tasks.base import StepOutput, TaskData, TaskRuntime
from tabular_task.config import TabularConfig
from tabular_task.data import make_clusters, split


class MLP(nn.Module):
    def __init__(self, features: int, hidden_sizes: list[int], classes: int, dropout: float):
        super().__init__()
        layers: list[nn.Module] = []
        width = features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Standardizer:
    """Feature means and deviations of the training rows. Checkpointed (``register_for_checkpointing``):
    a resumed run must standardise as the checkpoint's weights were trained."""

    def __init__(self, x: np.ndarray):
        self.mean, self.std = x.mean(axis=0), x.std(axis=0) + 1e-6

    def __call__(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((x - self.mean) / self.std).astype(np.float32))

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.tolist(), "std": self.std.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not (np.allclose(state["mean"], self.mean) and np.allclose(state["std"], self.std)):
            raise ConfigError("the checkpoint was trained on other data (its feature statistics differ); resume with "
                              "the task settings it was trained with.")


class TabularTask:
    config_class = TabularConfig
    """The schema the app checks conf/task/tabular.yaml's keys against."""

    def __init__(self, cfg: TabularConfig):
        cfg.check()
        self.cfg = cfg
        self.name = cfg.name
        self.metric_names = ("loss", "accuracy", "f1")
        self.standardize: Standardizer | None = None

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        c = self.cfg
        x, y = make_clusters(c.samples, c.features, c.classes, c.class_separation, c.data_seed)
        train, held_out = split(c.samples, c.eval_fraction, c.data_seed)
        self.standardize = Standardizer(x[train])
        runtime.register_for_checkpointing(self.standardize)
        return TaskData(train=TensorDataset(self.standardize(x[train]), torch.from_numpy(y[train])),
                        eval=TensorDataset(self.standardize(x[held_out]), torch.from_numpy(y[held_out])))

    def build_model(self) -> nn.Module:
        c = self.cfg
        return MLP(c.features, list(c.hidden_sizes), c.classes, c.dropout)

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        x, y = batch
        logits = model(x)
        # One loss per sample: the engine averages over the samples of the whole optimizer step.
        return StepOutput(sample_losses=F.cross_entropy(logits, y, reduction="none"), sample_items=1,
                          logits=logits, labels=y)

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Over the whole evaluation set, gathered from every process: loss, accuracy, macro-F1."""
        predictions = logits.argmax(dim=-1)
        classes = torch.arange(self.cfg.classes)
        hit = (predictions[:, None] == classes) & (labels[:, None] == classes)
        predicted, actual = (predictions[:, None] == classes).sum(0), (labels[:, None] == classes).sum(0)
        f1 = 2 * hit.sum(0) / (predicted + actual).clamp(min=1)
        return {"loss": F.cross_entropy(logits.float(), labels).item(),
                "accuracy": (predictions == labels).double().mean().item(),
                "f1": f1.double().mean().item()}

    def save_artifacts(self, model: nn.Module, folder: Path) -> None:
        """What the exported weights need to be used: the schema's values and the standardisation."""
        assert self.standardize is not None
        info = {"config": asdict(self.cfg), "standardize": self.standardize.state_dict()}
        (Path(folder) / "tabular.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
