"""Tasks: data + model + metric. ``build_task`` maps a task config to its task object."""

from __future__ import annotations

from app.tasks.base import StepOutput, Task, TaskData
from app.tasks.digits import DigitsConfig, DigitsTask
from app.tasks.glue_mrpc_config import GlueMrpcConfig

# name -> config schema. The task classes are imported lazily in build_task so that heavy
# dependencies (transformers, datasets) load only when their task runs.
TASK_SCHEMAS = {"digits": DigitsConfig, "glue_mrpc": GlueMrpcConfig}


def build_task(cfg: object) -> Task:
    if isinstance(cfg, DigitsConfig):
        return DigitsTask(cfg)
    if isinstance(cfg, GlueMrpcConfig):
        from app.tasks.glue_mrpc import GlueMrpcTask

        return GlueMrpcTask(cfg)
    raise TypeError(f"no task is registered for config {type(cfg).__name__}")


__all__ = ["StepOutput", "Task", "TaskData", "TASK_SCHEMAS", "build_task"]
