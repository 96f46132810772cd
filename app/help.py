"""``python -m app --help``: each config group's options, one line each, the group's main keys, and
the README's examples. Built from ``conf/`` and the schemas, so it cannot go stale; Hydra's own
listing would also show the schemas stored beside the options (``hardware_schema``...). Each option
shows its file's first sentence, or the values it sets as the default run uses them (the default
task's recipe applied over them); the options Hydra's plugins bring are listed beside ours.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml  # type: ignore[import-untyped]

from app.config import RunConfig
from app.config_tree import _scalar

USAGE = """usage: python -m app [group=option ...] [key=value ...]

  python -m app --cfg job            print the composed config and exit
  python -m app -m key=a,b           a sweep (Hydra multirun): one run folder per job
  python -m app resume=<run folder>  continue a run (its own overrides are reused)
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
            shown.append(f"{key}: {_scalar(recipe[key])} (the {task} task's; the option alone: {_scalar(value)})")
        else:
            shown.append(f"{key}: {_scalar(value)}")
    return ", ".join(shown)


def _task_recipe(conf_dir: Path, task: str | None) -> dict[str, dict[str, object]]:
    """The values the default task's option file sets in other groups (``optim: lr: 3e-3``...)."""
    path = conf_dir / "task" / f"{task}.yaml"
    if task is None or not path.exists():
        return {}
    loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {group: values for group, values in loaded.items() if group != "task" and isinstance(values, dict)}


def _defaults(conf_dir: Path) -> dict[str, str | None]:
    loaded = yaml.safe_load((conf_dir / "config.yaml").read_text(encoding="utf-8"))
    chosen: dict[str, str | None] = {}
    for item in loaded.get("defaults", []):
        if isinstance(item, dict):
            for group, option in item.items():
                chosen[str(group).split("/")[-1].split("@")[0]] = None if option is None else str(option)
    return chosen


def _keys(group: str, options: list[Path]) -> list[str]:
    """The schema's fields; for groups whose schema depends on the option (task, optim), the keys
    their option files set, or, for an option that sets none (its values are its schema's defaults),
    its schema's fields."""
    field = {f.name: f for f in dataclasses.fields(RunConfig)}.get(group)
    factory = getattr(field, "default_factory", None) if field is not None else None
    if factory is not None and factory is not dataclasses.MISSING:
        return [f.name for f in dataclasses.fields(factory())]
    if field is None:
        return []
    keys: dict[str, None] = {}
    for option in options:
        text = option.read_text(encoding="utf-8")
        loaded = yaml.safe_load(text) or {}
        if isinstance(loaded.get(group), dict):
            own = loaded[group]
        elif text.startswith("# @package _global_"):  # it sets other groups' keys only
            own = _schema_fields(group, loaded.get("defaults") or [])
        else:
            own = loaded
        keys.update((k, None) for k in own if k not in ("defaults", "name", "_target_"))
    return list(keys)


def _schema_fields(group: str, defaults: list[object]) -> list[str]:
    """The fields of the schema an option file names first (``/task/<name>_schema@task``), from Hydra's
    ConfigStore (filled by ``app.configure.register_configs``)."""
    from hydra.core.config_store import ConfigStore

    for entry in defaults:
        if isinstance(entry, str) and entry.endswith(f"_schema@{group}"):
            node = ConfigStore.instance().load(f"{entry.lstrip('/').split('@')[0]}.yaml").node
            return [str(k) for k in node]
    return []


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


def app_help(conf_dir: Path) -> str:
    defaults = _defaults(conf_dir)
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
        keys = _keys(group, options)
        if keys:
            out.append(f"     keys: {', '.join(f'{group}.{k}' for k in keys)}")
    top = [f.name for f in dataclasses.fields(RunConfig) if f.name not in defaults]
    out.append(f"\nTop-level keys: {', '.join(top)}")
    examples = _examples(conf_dir.parent / "README.md")
    if examples:
        out.append("\nExamples:")
        out.extend(f"  {line}" for line in examples)
    return "\n".join(out) + "\n"
