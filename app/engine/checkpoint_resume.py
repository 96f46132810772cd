"""What a ``resume=`` path may name besides a checkpoint. (The command line a resume becomes is built
before Hydra starts, in ``app/launching/resume_argv.py``.)"""

from __future__ import annotations

from pathlib import Path

from app.run_layout import adapter_dir


def is_model_folder(path: Path) -> bool:
    """An exported model (``<run folder>/model/``, or ``Accelerator.save_model``'s folder, its weights
    in one file or in shards with an index; or an export of peft adapters alone, ``adapter/``), not a
    checkpoint."""
    return (((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
             or (adapter_dir(path) / "adapter_config.json").is_file())
            and not (path / "manifest.json").exists())
