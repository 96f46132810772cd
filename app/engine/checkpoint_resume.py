"""What a ``resume=`` path may name besides a checkpoint. (The command line a resume becomes is built
before Hydra starts, in ``app/cli/argv.py``: ``argv_for_resume``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.run_folder.layout import EXPORT_FILE, MANIFEST_FILE, adapter_dir, model_dir

ADAPTER_CONFIG_FILE = "adapter_config.json"
"""peft's file in an adapter folder (``<export>/adapter/``)."""


def has_model_weights(folder: Path) -> bool:
    """Whether the folder holds a model's weights as ``Accelerator.save_model`` writes them: in one file
    or in shards with an index."""
    return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()


def is_model_folder(path: Path) -> bool:
    """An exported model (``<run folder>/model/``, or ``Accelerator.save_model``'s folder; or an export of
    peft adapters alone, ``adapter/``), not a checkpoint."""
    return ((has_model_weights(path) or (adapter_dir(path) / ADAPTER_CONFIG_FILE).is_file())
            and not (path / MANIFEST_FILE).exists())


def exported_model_of(run_folder: Path) -> Path | None:
    """The model a run folder exported (``<run folder>/model/``), None when it has none. ``mode=eval
    resume=<run folder>`` evaluates it: the weights the run chose to keep (its best evaluation's, with
    ``checkpoint.export=best``), not whatever its newest checkpoint holds."""
    exported = model_dir(run_folder)
    return exported if is_model_folder(exported) else None


def export_description(model_folder: Path) -> dict[str, Any]:
    """``model/export.json`` (which weights, from which step and checkpoint); empty when absent or unreadable."""
    try:
        described = json.loads((model_folder / EXPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return described if isinstance(described, dict) else {}
