"""A task's generations at each evaluation (``task.sample_prompts`` of ``task=sft``), written to
``<run>/samples/step_<step>.jsonl`` and to the trackers."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from app.run_folder.layout import samples_file
from app.tasks.base import WritesSamples

if TYPE_CHECKING:
    from app.engine.loop import Components


def write_samples(c: Components, task: WritesSamples, step: int) -> None:
    """The task's generations at this evaluation, to ``<run>/samples/step_<step>.jsonl`` and the trackers
    (main process). The main process generates alone, unless the model is sharded (FSDP2), where every
    process runs the same generation and the main one writes."""
    acc = c.accelerator
    sharded = acc.shards_the_model
    if not (acc.is_main_process or sharded):
        return
    model = c.model if sharded else acc.unwrap_model(c.model)
    c.model.eval()
    try:
        with c.evaluation_weights():
            rows = task.evaluation_samples(model, acc.device)
    finally:
        c.model.train()
    if not rows or not acc.is_main_process or acc.project_dir is None:
        return
    path = samples_file(acc.project_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    acc.log_table("eval/samples", rows, step, path)
