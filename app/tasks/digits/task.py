"""Default task: scikit-learn's bundled 8x8 handwritten digits, an MLP, accuracy and macro-F1.

The data ships inside scikit-learn, so ``python -m app`` trains offline on a fresh machine; it is read
without importing scikit-learn (``app.tasks.digits.data``: same samples, same split, 1.2 s less start-up).
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

from app.tasks.base import StepOutput, TaskData, TaskRuntime
from app.tasks.digits.config import DigitsConfig
from app.tasks.digits.data import load_digits
from app.tasks.metrics import classification_metrics
from app.tasks.splits import stratified_split


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_sizes: list[int], num_classes: int, dropout: float):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsTask:
    name = "digits"
    metric_names: tuple[str, ...] = ("loss", "accuracy", "f1")
    num_classes = 10
    num_features = 64

    def __init__(self, cfg: DigitsConfig):
        cfg.check()  # also when built from a config that did not pass through app.launching.validate
        self.cfg = cfg

    def build_data(self, runtime: TaskRuntime | None) -> TaskData:
        pixels, labels = load_digits()
        # Pixel values are 0..16; scaling to 0..1 keeps the MLP well conditioned.
        x = (pixels / 16.0).astype(np.float32)
        y = labels.astype(np.int64)
        train, held_out = stratified_split(y, self.cfg.eval_fraction, self.cfg.split_seed)
        return TaskData(
            train=TensorDataset(torch.from_numpy(x[train]), torch.from_numpy(y[train])),
            eval=TensorDataset(torch.from_numpy(x[held_out]), torch.from_numpy(y[held_out])),
        )

    def build_model(self) -> nn.Module:
        return MLP(self.num_features, list(self.cfg.hidden_sizes), self.num_classes, self.cfg.dropout)

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        x, y = batch
        logits = model(x)
        # Per sample, one item each: the engine averages over the samples of the whole optimizer step.
        return StepOutput(sample_losses=F.cross_entropy(logits, y, reduction="none"), sample_items=1,
                          logits=logits, labels=y)

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        return classification_metrics(logits, labels, f1_average="macro")

    def save_artifacts(self, model: nn.Module, folder: Path) -> None:
        (folder / "task.json").write_text(json.dumps({"task": self.name, **asdict(self.cfg)}, indent=2))

    def checkpoint_blocks(self, model: nn.Module) -> list[nn.Module]:
        """trainer.gradient_checkpointing: the MLP's linear layers (app.tasks.base.CheckpointsBlocks). On a
        model this small it saves nothing worth having (a linear layer keeps only its input, which the
        checkpoint keeps too); it is the protocol's example, and what its tests drive."""
        return [m for m in model.modules() if isinstance(m, nn.Linear)]

    def card_facts(self) -> dict[str, str]:
        """What the model card says of the model and the data (app.tasks.base.DescribesItself)."""
        widths = "-".join(str(w) for w in (self.num_features, *self.cfg.hidden_sizes, self.num_classes))
        return {"title": f"MLP {widths} on 8×8 digits",
                "base model": f"an MLP {widths} (dropout {self.cfg.dropout:g}) trained from scratch (app/tasks/digits/task.py)",
                "labels": f"{self.num_classes} classes, the digits 0–9",
                "data": "scikit-learn's bundled 8×8 handwritten digits (1,797 images, pixels scaled to [0, 1]); "
                        f"{self.cfg.eval_fraction:.0%} held out for evaluation, stratified (task.split_seed="
                        f"{self.cfg.split_seed})."}
