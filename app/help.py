"""``python -m app --help``: each config group's options, one line each, the group's main keys, and
the README's examples. Built from ``conf/`` and the schemas, so it cannot go stale; Hydra's own
listing would also show the schemas stored beside the options (``hardware_schema``...).
"""

from __future__ import annotations

import dataclasses
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


def _description(path: Path) -> str:
    """The option file's first comment line, else the values it sets."""
    text = path.read_text(encoding="utf-8")
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("# @package"):
            return stripped.lstrip("# ").strip()
        if stripped and not stripped.startswith("#"):
            break
    loaded = yaml.safe_load(text) or {}
    values = {k: v for k, v in loaded.items() if k != "defaults" and not isinstance(v, dict)}
    return ", ".join(f"{k}: {_scalar(v)}" for k, v in values.items())


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
    out = [USAGE, "Config groups (group=option); the default is marked *:"]
    group_dirs = sorted({p.parent for p in conf_dir.rglob("*.yaml") if p.parent != conf_dir})
    for group_dir in group_dirs:
        group = group_dir.relative_to(conf_dir).as_posix()  # e.g. hydra/launcher
        chosen = defaults.get(group)
        out.append(f"\n  {group}" + ("" if group in defaults and chosen is not None else "  (none by default)"))
        options = sorted(group_dir.glob("*.yaml"))
        for option in options:
            mark = "*" if option.stem == chosen else " "
            out.append(f"   {mark} {option.stem:<16} {_description(option)}".rstrip())
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
