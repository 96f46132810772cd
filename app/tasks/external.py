"""Tasks defined outside ``app/``: a task YAML in the user's own config folder names the class.

    # my_conf/task/my_task.yaml            python -m app --config-dir my_conf task=my_task
    # @package _global_
    task:
      _target_: my_package.MyTask    # implements the Task protocol (app/tasks/base.py)
      hidden: 64                     # fields of MyTask.config_class

Our task options name their schema in ``defaults``; the user's cannot (Hydra's ConfigStore only
knows what our code stored), so Hydra composes the node as it is, and :func:`typed_task_config`
turns it into the class's schema (``config_class``: a dataclass subclassing
``app.config.TaskConfig``) right after composition, refusing an unknown key or a wrong type in one
sentence, as Hydra does for ours. The class path travels with the typed config as its ``_target_``
attribute (not a field, so the schema's fields stay the user's), through pickling into the workers
of a multi-process run, where :func:`external_task_class` finds the class again.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from app.config import ConfigError, TaskConfig

TARGET = "_target_"
TASK_METHODS = ("build_data", "build_model", "step", "compute_metrics", "save_artifacts")
"""What a task class must define (``name`` and ``metric_names`` may be set by its constructor)."""


def typed_task_config(node: Any) -> TaskConfig:
    """The composed ``task`` node as a schema instance: ours come typed already; a dict with
    ``_target_`` becomes its class's ``config_class``."""
    if isinstance(node, TaskConfig):
        return node
    if not isinstance(node, dict) or TARGET not in node:
        raise ConfigError("the task option names neither a schema of ours nor a class: give its YAML "
                          "task._target_=<your package>.<YourTask> (see docs/tasks.md, the Task protocol).")
    target = str(node[TARGET])
    schema = getattr(import_task_class(target), "config_class", None)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema) and issubclass(schema, TaskConfig)):
        raise ConfigError(f"task._target_={target} has no config_class, a dataclass subclassing "
                          "app.config.TaskConfig that lists its configuration keys.")
    values = {key: value for key, value in node.items() if key != TARGET}
    fields = [f.name for f in dataclasses.fields(schema)]
    if unknown := [key for key in values if key not in fields]:
        raise ConfigError(f"unknown configuration key task.{unknown[0]}: {schema.__name__} has the keys "
                          f"{', '.join(fields)}.")
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"task.{key} is refused by {schema.__name__}: {str(err).splitlines()[0].rstrip('.')}.") from None
    assert isinstance(cfg, TaskConfig)
    setattr(cfg, TARGET, target)
    return cfg


def external_task_class(cfg: TaskConfig) -> Any:
    """The class a user's task config came with (None for our schemas)."""
    target = getattr(cfg, TARGET, None)
    return import_task_class(target) if isinstance(target, str) else None


def import_target(target: str, key: str) -> Any:
    """The object a dotted path names (``package.module.name``), imported as Python finds it: from the
    working directory, ``PYTHONPATH`` or an installed package; ``key`` names the setting in the sentence
    that refuses it (``task._target_``, ``task.rewards[0]._target_``)."""
    module_name, _, name = target.rpartition(".")
    if not module_name:
        raise ConfigError(f"{key}={target} must be a dotted path, <package>.<module>.<name>.")
    try:
        return getattr(importlib.import_module(module_name), name)
    except ImportError as err:
        raise ConfigError(f"{key}={target} cannot be imported ({err}); run from the folder that holds "
                          "its package, or install it (pip install -e <folder>).") from None
    except AttributeError:
        raise ConfigError(f"{key}={target}: module {module_name} has no {name}.") from None


def import_task_class(target: str) -> Any:
    task_class = import_target(target, "task._target_")
    missing = [method for method in TASK_METHODS if not callable(getattr(task_class, method, None))]
    if missing:
        raise ConfigError(f"task._target_={target} is not a task: it has no {', '.join(missing)} (the Task protocol, "
                          "app/tasks/base.py).")
    return task_class
