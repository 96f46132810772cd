"""Hydra's composition errors as the app's one sentence: an unknown option lists the real options (not
the schemas stored beside them), and an unknown key says what it is instead (ours of that name, the task
that has it, ours for TRL's option of that name, the closest spelling) instead of Hydra's hint to add it
with ``+``, which the app then refuses, and names the command that lists this run's keys. Torch-free."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from hydra.errors import ConfigCompositionException, MissingConfigException

from app.cli.configure import CONF_DIR, SCHEMA_SUFFIX
from app.cli.help import default_options, run_keys
from app.cli.trl_names import TRL_NAMES
from app.tasks import TASK_SCHEMAS


def closest_key(key: str, schema: Any) -> str | None:
    """The field of the dataclass ``schema`` (a class or an instance) nearest to the last part of the
    dotted ``key``, as a full dotted key: ``trainer.batchsize`` -> ``trainer.batch_size``."""
    if not dataclasses.is_dataclass(schema):
        return None
    prefix, _, name = key.rpartition(".")
    fields = [f.name for f in dataclasses.fields(schema)]
    match = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    return f"{prefix}.{match[0]}" if prefix and match else match[0] if match else None


def unknown_key_sentence(key: str, schema: Any, added: bool = False, chosen: dict[str, str] | None = None,
                         config_dirs: tuple[str, ...] = ()) -> str:
    """``unknown configuration key K; <what K is instead>; python -m app <the chosen options> --cfg job lists
    the keys`` (``added``: it came with Hydra's ``+``; ``chosen``: the command line's ``group=option``
    choices, so the keys listed are this run's, e.g. ``task=sft``'s; ``config_dirs``: its ``--config-dir``
    folders). What K is instead, the first that applies: the key of this run with the same name
    (``batch_size`` -> ``trainer.batch_size``); the task that has it (``task.beta`` is ``task=dpo``'s); the
    key TRL's and Transformers' option of that name is here (``learning_rate`` -> ``optim.lr``,
    ``app.cli.trl_names``); the closest spelling among the schema's keys."""
    chosen = {group: option for group, option in (chosen or {}).items() if "," not in option and "(" not in option}
    how = f" (added with +{key}=...)" if added else ""
    name = key.rpartition(".")[2]
    known = _run_keys(chosen)
    task = chosen.get("task") or _default_task()
    same_name = [k for k in known if k != key and (k == name or k.endswith(f".{name}"))]
    trl = TRL_NAMES.get(name)
    other_tasks = _tasks_with(key, task)
    near = closest_key(key, schema)
    if same_name:
        instead = f"; did you mean {' or '.join(same_name[:2])}? "
    elif trl is not None:
        ours = trl.key.split("=")[0]
        where = "" if ours in known or not ours.startswith("task.") else _task_list(_tasks_with(ours, task))
        instead = f": {trl.sentence(name, where, see='docs/coming-from-trl.md')}; "
    elif other_tasks:
        instead = f": it is a key of {_task_list(other_tasks)}, not of task={task}; "
    elif near:
        instead = f"; did you mean {near}? "
    else:
        instead = "; "
    command = " ".join(["python -m app", *(f"--config-dir {d}" for d in config_dirs),
                        *(f"{group}={option}" for group, option in chosen.items()), "--cfg job"])
    return f"unknown configuration key {key}{how}{instead}{command} lists the keys."


def _task_list(tasks: list[str]) -> str:
    """``task=causal_lm, task=sft and task=dpo``."""
    named = [f"task={task}" for task in tasks]
    return " and ".join(named) if len(named) < 3 else f"{', '.join(named[:-1])} and {named[-1]}"


def _default_task() -> str:
    return default_options(CONF_DIR).get("task") or ""


def _run_keys(chosen: dict[str, str]) -> list[str]:
    try:
        return run_keys(CONF_DIR, chosen)
    except Exception:  # noqa: BLE001 - an option that is not there: the sentence goes on without the run's keys
        return []


def _tasks_with(key: str, task: str) -> list[str]:
    """Our tasks other than ``task`` whose schema has the ``task.<name>`` key ``key`` (and uses it)."""
    group, _, name = key.partition(".")
    if group != "task" or "." in name:
        return []
    return [other for other, schema in TASK_SCHEMAS.items()
            if other != task and name in {f.name for f in dataclasses.fields(schema)} and name not in schema.UNUSED]


def composition_sentence(err: ConfigCompositionException, chosen: dict[str, str] | None = None,
                         config_dirs: tuple[str, ...] = ()) -> str:
    """One sentence for what Hydra refused while composing the config (``chosen`` and ``config_dirs``: the
    command line's options and config folders, as :func:`unknown_key_sentence` takes them)."""
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        options = [o for o in (err.options or []) if not o.endswith(SCHEMA_SUFFIX)]
        if options:
            return f"{group}={option} is not an option of {group}; choose one of {', '.join(options)}."
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None)
    if str(err).startswith("Could not override") and full_key and type(cause).__name__ in (
            "ConfigAttributeError", "ConfigKeyError"):
        return unknown_key_sentence(str(full_key), getattr(cause, "object_type", None), chosen=chosen,
                                    config_dirs=config_dirs)
    first = str(err).strip().splitlines()[0].rstrip(".")
    detail = str(cause).strip().splitlines()[0].rstrip(".") if cause is not None and str(cause).strip() else ""
    return f"{first}: {detail}." if detail else f"{first}."
