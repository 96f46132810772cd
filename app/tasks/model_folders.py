"""A model key (``task.model``, ``task.config``, ``task.tokenizer``) given a run folder instead of the model
exported in it: refused in one sentence that names ``<run>/model``, when the config is checked (before a
folder is made or a library is asked, whose own error would not say it). Torch-free."""

from __future__ import annotations

from pathlib import Path

from app.config import ConfigError
from app.run_folder.layout import MODEL_DIR


def refuse_run_folder(key: str, value: str | None) -> None:
    """``<key>=<run> is a run folder, not a model folder: its exported model is <key>=<run>/model.``
    when ``value`` is a folder without a ``config.json`` of its own and with an exported model inside."""
    if not value:
        return
    folder = Path(value).expanduser()
    if (folder / MODEL_DIR / "config.json").is_file() and not (folder / "config.json").exists():
        raise ConfigError(f"{key}={value} is a run folder, not a model folder: its exported model is "
                          f"{key}={folder / MODEL_DIR}.")
