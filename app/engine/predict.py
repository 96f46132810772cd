"""Predictions on a task's unlabeled test split, after training (``task.predict_test=true``).

A task that offers it is a :class:`app.tasks.base.PredictsTest`: ``test_dataset()``,
``predict(model, batch)`` (its outputs, e.g. logits) and ``write_predictions(outputs, path)``; every
process predicts its share of the split, the outputs are gathered in file order (padding duplicates
dropped), and the main process turns them into predictions and writes them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from app.config import ConfigError
from app.engine.loop import Components
from app.tasks.base import PredictsTest

log = logging.getLogger(__name__)


@torch.no_grad()
def write_test_predictions(c: Components, path: Path) -> None:
    acc, task = c.accelerator, c.task
    if not isinstance(task, PredictsTest):
        raise ConfigError(f"task.predict_test=true needs a task that predicts its test split, and {task.name} "
                          "does not.")
    dataset = task.test_dataset()
    loader = DataLoader(dataset, batch_size=c.eval_loader.batch_size, shuffle=False,
                        collate_fn=c.eval_loader.collate_fn)
    loader = acc.prepare(loader)
    predictions = []
    c.model.eval()
    with c.evaluation_weights():
        for batch in loader:
            outputs = task.predict(c.model, batch)
            predictions.append(acc.gather_for_metrics(outputs.float()).cpu())
    c.model.train()
    if acc.is_main_process:
        task.write_predictions(torch.cat(predictions), path)
        log.info("wrote %d test predictions to %s", len(dataset), path)
    acc.wait_for_everyone()
