"""Tasks: data + model + metric. ``build_task`` maps a task config to its task object.

- ``base``: the interface the engine drives (``Task``, ``TaskData``, ``StepOutput``); ``metrics``.
- ``digits`` (+ ``digits_config``): scikit-learn's digits, an MLP.
- ``glue/``: what every GLUE task shares (data sources, TSV parser, tokenization cache, models, hub
  probing, the generic ``GlueTask``); one file per GLUE task beside it: ``glue_mrpc`` (+ its schema
  ``glue_mrpc_config``), ``glue_sst2``. ``mean_pooling``: the mean-pooling classifier head.

The schemas import nothing heavy, so composing and validating a config stays fast; each task class
(and torch, transformers, datasets with it) is imported only when that task runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config import TaskConfig
from app.tasks.digits_config import DigitsConfig
from app.tasks.glue.config import GlueConfig
from app.tasks.glue_mrpc_config import GlueMrpcConfig
from app.tasks.glue_sst2 import GlueSst2Config

if TYPE_CHECKING:
    from app.tasks.base import Task

TASK_SCHEMAS: dict[str, type[TaskConfig]] = {
    "digits": DigitsConfig,
    "glue_mrpc": GlueMrpcConfig,
    "glue_sst2": GlueSst2Config,
}


def build_task(cfg: TaskConfig) -> Task:
    if isinstance(cfg, DigitsConfig):
        from app.tasks.digits import DigitsTask

        return DigitsTask(cfg)
    if isinstance(cfg, GlueMrpcConfig):
        from app.tasks.glue_mrpc import GlueMrpcTask

        return GlueMrpcTask(cfg)
    if isinstance(cfg, GlueConfig):  # a GLUE task without behaviour of its own: its spec says it all
        from app.tasks.glue.task import GlueTask

        return GlueTask(cfg)
    raise TypeError(f"no task is registered for config {type(cfg).__name__}")


__all__ = ["TASK_SCHEMAS", "DigitsConfig", "GlueMrpcConfig", "GlueSst2Config", "build_task"]
