"""The run configuration put together from its registries for Hydra: the schemas of ``app.config`` with
the tasks' (``app.tasks``) in Hydra's ConfigStore, the composed config turned into those dataclasses
once (``to_run_config``), and the command line's limits on the run's length (``limits_as_given``).
The rules the config must then pass are ``app.launching.validate``'s. Torch-free.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from app.config import (
    AdamWConfig,
    AdapterConfig,
    CheckpointConfig,
    ConfigError,
    EarlyStoppingConfig,
    HardwareConfig,
    LoggingConfig,
    LoraAdapterConfig,
    PrecisionConfig,
    RunConfig,
    SchedulerConfig,
    SGDConfig,
    TrainerConfig,
)
from app.launching.overrides import override_key
from app.tasks import TASK_SCHEMAS
from app.tasks.external import typed_task_config
from app.this_process import available_cores

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The app's Hydra config folder (``conf/``, beside ``app/``)."""


SCHEMA_SUFFIX = "_schema"
"""The end of a schema's name in the ConfigStore (``lora_schema``), which sets it apart from the options."""

GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "hardware": {"hardware_schema": HardwareConfig},
    "precision": {"precision_schema": PrecisionConfig},
    "optim": {"adamw_schema": AdamWConfig, "sgd_schema": SGDConfig},
    "scheduler": {"scheduler_schema": SchedulerConfig},
    "trainer": {"trainer_schema": TrainerConfig},
    "checkpoint": {"checkpoint_schema": CheckpointConfig},
    "early_stopping": {"early_stopping_schema": EarlyStoppingConfig},
    "logging": {"logging_schema": LoggingConfig},
    "adapter": {"adapter_schema": AdapterConfig, "lora_schema": LoraAdapterConfig},
    "task": {f"{name}_schema": schema for name, schema in TASK_SCHEMAS.items()},
}
"""Each config group's schemas by the name a YAML option extends (``defaults: [lora_schema]``)."""


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore; YAML options extend them by name."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, schemas in GROUP_SCHEMAS.items():
        for name, schema in schemas.items():
            cs.store(group=group, name=name, node=schema_node(schema))
    register_grid_sweeper(cs)
    OmegaConf.register_new_resolver("app.parallel_jobs", parallel_jobs, replace=True)


def list_keys() -> frozenset[str]:
    """The dotted keys whose value is a list in every schema that has them (``adapter.target_modules``,
    ``logging.trackers``, ``task.text_fields``...): a bare value given to one is a list of one."""
    lists: set[str] = set()
    others: set[str] = set()
    for group, schemas in GROUP_SCHEMAS.items():
        for schema in schemas.values():
            hints = typing.get_type_hints(schema)
            for f in dataclasses.fields(schema):
                is_list = list in (typing.get_origin(hints[f.name]),
                                   *(typing.get_origin(a) for a in typing.get_args(hints[f.name])))
                (lists if is_list else others).add(f"{group}.{f.name}")
    return frozenset(lists - others)


def schema_node(schema: type) -> DictConfig:
    """``schema`` as the node Hydra composes from, its free-key dicts left open: Hydra closes the whole
    config (a key the schema lacks is refused), and a ``dict[str, ...]`` field such as
    ``task.config_overrides`` has no keys of its own to lack, so ``task.config_overrides={hidden_size: 64}``
    and ``task.config_overrides.hidden_size=64`` must add them (the task checks them against the model's
    configuration). Every other key stays checked."""
    node = OmegaConf.structured(schema)
    _open_free_dicts(node, schema)
    return node


def _open_free_dicts(node: Any, schema: Any) -> None:
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if typing.get_origin(hint) is dict or _list_of_dicts(hint):
            # A list of free-form entries (task=grpo's task.rewards) is opened too: an entry's key it lacks
            # (task.rewards.0.weight=0.5) is set as the dict field's are.
            OmegaConf.set_struct(node[f.name], False)
        elif dataclasses.is_dataclass(hint):
            _open_free_dicts(node[f.name], hint)


def _list_of_dicts(hint: Any) -> bool:
    return typing.get_origin(hint) is list and typing.get_origin(next(iter(typing.get_args(hint)), None)) is dict


def to_run_config(dict_cfg: DictConfig) -> RunConfig:
    """The composed config as dataclasses, once (nothing below the entry point reads a DictConfig); a
    task from the user's package (``task._target_``) becomes its own schema here."""
    try:
        cfg = OmegaConf.to_object(dict_cfg)
    except Exception as err:  # noqa: BLE001 - OmegaConf reports missing values and bad interpolations
        raise ConfigError(f"invalid configuration: {err}".splitlines()[0]) from None
    assert isinstance(cfg, RunConfig)  # conf/config.yaml's root is run_schema
    cfg.task = typed_task_config(cfg.task)
    return cfg


def limits_as_given(cfg: RunConfig, overrides: Sequence[str]) -> None:
    """A limit on the run's length given on the command line (``overrides``: the job's, as Hydra
    records them) wins over a preset's: ``trainer.max_steps`` given without ``trainer.max_epochs`` lets
    the steps alone decide (``max_epochs=-1``), whatever epochs the task's recipe (``task=causal_lm``:
    1), the trainer's default or an experiment set, as ``max_steps`` overrides ``num_train_epochs`` in the
    HF Trainer and leaves Lightning's ``max_epochs`` unset. Both given: both count, the first reached
    ends the run and the start says which (``app.engine.budget``)."""
    given = {override_key(override) for override in overrides}
    if "trainer.max_steps" in given and "trainer.max_epochs" not in given and cfg.trainer.max_steps > 0:
        cfg.trainer.max_epochs = -1


def parallel_jobs(processes_per_job: int) -> int:
    """How many jobs of ``processes_per_job`` processes this machine's cores run at once (>= 1)."""
    return max(1, available_cores() // max(1, int(processes_per_job)))


def register_grid_sweeper(cs: ConfigStore) -> None:
    """``hydra/sweeper=basic`` (Hydra's default) becomes Hydra's grid sweeper that, with resume=auto,
    reads a sweep's finished jobs back instead of running them again (hydra_plugins/app_sweepers).

    Stored under Hydra's own name: an ``override hydra/sweeper`` in conf/config.yaml would also win
    over the one in hparams_search/*.yaml (Hydra keeps a group's first override). After Hydra's plugin
    scan, which stores Hydra's own ``basic`` again each time it runs (once per process).
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeperConf
    from hydra.core.plugins import Plugins

    Plugins.instance()

    @dataclass
    class ResumableBasicSweeperConf(BasicSweeperConf):
        _target_: str = "hydra_plugins.app_sweepers.resumable.ResumableBasicSweeper"

    cs.store(group="hydra/sweeper", name="basic", node=ResumableBasicSweeperConf, provider="app")
