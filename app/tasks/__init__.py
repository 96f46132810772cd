"""Tasks: data + model + metric. ``build_task`` maps a task config to its task object.

The schemas import nothing heavy, so composing and validating a config stays fast; each task class
(and torch, transformers, datasets with it) is imported only when that task runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config import TaskConfig
from app.tasks.digits_config import DigitsConfig
from app.tasks.glue_mrpc_config import GlueMrpcConfig

if TYPE_CHECKING:
    from app.tasks.base import Task

TASK_SCHEMAS: dict[str, type[TaskConfig]] = {"digits": DigitsConfig, "glue_mrpc": GlueMrpcConfig}


def build_task(cfg: TaskConfig) -> Task:
    if isinstance(cfg, DigitsConfig):
        from app.tasks.digits import DigitsTask

        return DigitsTask(cfg)
    if isinstance(cfg, GlueMrpcConfig):
        from app.tasks.glue_mrpc import GlueMrpcTask

        return GlueMrpcTask(cfg)
    raise TypeError(f"no task is registered for config {type(cfg).__name__}")


__all__ = ["TASK_SCHEMAS", "DigitsConfig", "GlueMrpcConfig", "build_task"]
