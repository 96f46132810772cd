"""Start the job: validate, then run here (one process) or in workers (several)."""

from __future__ import annotations

from pathlib import Path

from app.config import RunConfig, validate


def launch(cfg: RunConfig, run_dir: Path) -> float | None:
    import torch

    validate(cfg, torch.cuda.device_count())
    from app.engine.run import run

    return run(cfg, run_dir)
