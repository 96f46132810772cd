"""``python -m app --help``: each config group's options, one line each, the keys of the group's
chosen option, and the README's examples. Built from ``conf/`` and the schemas, so it cannot go stale;
Hydra's own listing would also show the schemas stored beside the options (``hardware_schema``...).
Each option shows its file's first sentence, or the values it sets as the run would use them (the
chosen task's recipe applied over them); the options Hydra's plugins bring are listed beside ours.
``python -m app task=causal_lm adapter=lora --help`` marks those options chosen and lists their keys
(every key of the option's schema: ``task.data_files.train``, ``adapter.r``...).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml  # type: ignore[import-untyped]

from app.cli.configure import SCHEMA_SUFFIX
from app.config import RunConfig
from app.console.config_tree import scalar_text

USAGE = """usage: python -m app [group=option ...] [key=value ...]

  python -m app --cfg job            print the composed config and exit
  python -m app -m key=a,b           a sweep (Hydra multirun): one run folder per job
  python -m app resume=<run folder>  continue a run (its own overrides are reused)
  python -m app task=causal_lm --help  the keys of that task (any group=option: that option's keys)
  python -m app --hydra-help         Hydra's own options
"""


PLUGIN_OPTIONS = {
    "hydra/launcher": {
        "basic": "Hydra's own: the jobs one after another, in this process.",
        "joblib": "hydra-joblib-launcher: the jobs at once, one per core (each in its own process).",
        "submitit_local": "hydra-submitit-launcher: each job as a local submitit job (its output in "
                          "<sweep>/.submitit/<id>/).",
    },
    "hydra/sweeper": {
        "basic": "Hydra's grid sweeper: every combination of the comma-separated values (with resume=auto, "
                 "finished jobs are read back, not run again).",
    },
}
"""Options that Hydra and its plugins bring (no file in conf/), each with its first sentence; the
first of each group is Hydra's default."""


def _first_sentence(text: str) -> str:
    """Up to the first full stop (not ``e.g.``/``i.e.``), or up to an example command (a description
    that introduces one with ``:`` ends there)."""
    command = re.search(r":?\s*python -m app\b", text)
    if command and command.start() > 0 and (command.group().startswith(":") or text[:command.start()].endswith(".")):
        text = text[:command.start()].rstrip()
        text = text if text.endswith(".") else text + "."
    for stop in re.finditer(r"\.(\s|$)", text):
        if not text[:stop.start() + 1].endswith(("e.g.", "i.e.")):
            return text[:stop.start() + 1]
    return text.strip()


def _description(path: Path) -> str:
    """The first sentence of the option file's leading comment, else the values it sets."""
    text = path.read_text(encoding="utf-8")
    comment: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# @package"):
            continue
        if not stripped.startswith("#"):
            break
        comment.append(stripped.lstrip("#").strip())
    if comment:
        return _first_sentence(" ".join(comment))
    return ""


def _values(path: Path, recipe: dict[str, object], task: str | None) -> str:
    """What the option sets, as the default run would use it: a task recipe (the default task's own
    lr, epochs..., applied after every group) wins over the option's value and is marked."""
    loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    values = {k: v for k, v in loaded.items() if k != "defaults" and not isinstance(v, dict)}
    shown = []
    for key, value in values.items():
        if key in recipe and recipe[key] != value:
            shown.append(f"{key}: {scalar_text(recipe[key])} (the {task} task's; the option alone: {scalar_text(value)})")
        else:
            shown.append(f"{key}: {scalar_text(value)}")
    return ", ".join(shown)


def _task_recipe(conf_dir: Path, task: str | None) -> dict[str, dict[str, object]]:
    """The values the default task's option file sets in other groups (``optim: lr: 3e-3``...)."""
    path = conf_dir / "task" / f"{task}.yaml"
    if task is None or not path.exists():
        return {}
    loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {group: values for group, values in loaded.items() if group != "task" and isinstance(values, dict)}


def default_options(conf_dir: Path) -> dict[str, str | None]:
    """Each group's default option, as ``conf/config.yaml``'s defaults list chooses it."""
    loaded = yaml.safe_load((conf_dir / "config.yaml").read_text(encoding="utf-8"))
    chosen: dict[str, str | None] = {}
    for item in loaded.get("defaults", []):
        if isinstance(item, dict):
            for group, option in item.items():
                chosen[str(group).split("/")[-1].split("@")[0]] = None if option is None else str(option)
    return chosen


def _keys(group: str, option: Path | None) -> list[str]:
    """Every key of the schema the chosen option names first in its ``defaults`` (``lora_schema``,
    ``/task/causal_lm_schema@task``), nested ones dotted (``data_files.train``); none for a group
    that is no part of the run config (``debug``, ``experiment``) or without a chosen option."""
    if group not in {f.name for f in dataclasses.fields(RunConfig)} or option is None or not option.exists():
        return []
    loaded = yaml.safe_load(option.read_text(encoding="utf-8")) or {}
    for entry in loaded.get("defaults") or []:
        if isinstance(entry, str) and entry.split("@")[0].endswith(SCHEMA_SUFFIX):
            path = entry.split("@")[0].lstrip("/")
            return _schema_keys(path if "/" in path else f"{group}/{path}")
    return []


def _schema_keys(stored: str) -> list[str]:
    """The keys of a schema in Hydra's ConfigStore (filled by ``app.cli.configure.register_configs``), a
    nested dataclass's dotted; a task's ``name`` (set by its option) is left out, and so are the keys it
    inherits but does not use (``TaskConfig.UNUSED``: task=dpo's ``task.sample_prompts``)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import DictConfig, OmegaConf

    def walk(node: DictConfig, prefix: str) -> list[str]:
        keys = []
        for key in map(str, node):
            value = node._get_node(key)
            if isinstance(value, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(value)):
                keys += walk(value, f"{prefix}{key}.")
            elif not (prefix == "" and key == "name"):
                keys.append(f"{prefix}{key}")
        return keys

    node = ConfigStore.instance().load(f"{stored}.yaml").node
    unused = getattr(OmegaConf.get_type(node), "UNUSED", {})
    return [key for key in walk(node, "") if key not in unused]


def _examples(readme: Path) -> list[str]:
    if not readme.exists():
        return []
    lines = readme.read_text(encoding="utf-8").splitlines()
    try:
        start = lines.index("## Examples")
    except ValueError:
        return []
    block: list[str] = []
    inside = False
    for line in lines[start + 1:]:
        if line.startswith("```"):
            if inside:
                break
            inside = True
            continue
        if inside:
            block.append(line)
    return block


def chosen_options(argv: list[str], conf_dir: Path) -> dict[str, str]:
    """The ``group=option`` choices of a command line (``task=causal_lm``), for the groups of ``conf/``."""
    groups = {p.parent.relative_to(conf_dir).as_posix() for p in conf_dir.rglob("*.yaml") if p.parent != conf_dir}
    pairs = (arg.lstrip("+").split("=", 1) for arg in argv if "=" in arg)
    return {group: option for group, option in pairs if group in groups}


def run_keys(conf_dir: Path, picked: dict[str, str] | None = None) -> list[str]:
    """Every key of the run these options compose (``task.block_size``, ``trainer.batch_size``, ``seed``...),
    each group's from the schema its chosen option names (``picked`` over the defaults)."""
    defaults = {**default_options(conf_dir), **(picked or {})}
    keys = []
    for f in dataclasses.fields(RunConfig):
        if f.name not in defaults:
            keys.append(f.name)
            continue
        option = defaults[f.name]
        if option is not None and "," not in option:
            keys += [f"{f.name}.{key}" for key in _keys(f.name, conf_dir / f.name / f"{option}.yaml")]
    return keys


def app_help(conf_dir: Path, picked: dict[str, str] | None = None) -> str:
    """The help text; ``picked``: options the command line chooses (``{"task": "causal_lm"}``) over the defaults."""
    defaults = {**default_options(conf_dir), **(picked or {})}
    recipe = _task_recipe(conf_dir, defaults.get("task"))
    out = [USAGE, "Config groups (group=option); the default is marked *:"]
    group_dirs = {p.parent.relative_to(conf_dir).as_posix() for p in conf_dir.rglob("*.yaml") if p.parent != conf_dir}
    for group in sorted(group_dirs | set(PLUGIN_OPTIONS)):
        plugins = PLUGIN_OPTIONS.get(group, {})
        chosen = defaults.get(group) or next(iter(plugins), None)
        out.append(f"\n  {group}" + ("" if chosen is not None else "  (none by default)"))
        options = sorted((conf_dir / group).glob("*.yaml"))
        lines = {name: text for name, text in plugins.items()}
        for option in options:
            lines[option.stem] = _description(option) or _values(option, recipe.get(group, {}), defaults.get("task"))
        for name in sorted(lines):
            mark = "*" if name == chosen else " "
            out.append(f"   {mark} {name:<16} {lines[name]}".rstrip())
        keys = _keys(group, conf_dir / group / f"{chosen}.yaml" if chosen is not None else None)
        if keys:
            out.append(f"     keys: {', '.join(f'{group}.{k}' for k in keys)}")
    top = [f.name for f in dataclasses.fields(RunConfig) if f.name not in defaults]
    out.append(f"\nTop-level keys: {', '.join(top)}")
    examples = _examples(conf_dir.parent / "README.md")
    if examples:
        out.append("\nExamples:")
        out.extend(f"  {line}" for line in examples)
    return "\n".join(out) + "\n"
