"""A run's ``metrics.jsonl`` as tests read it: every row, and the rows without their throughput."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.engine.throughput import MFU, SAMPLES_PER_S, TOKENS_PER_S

THROUGHPUT = (SAMPLES_PER_S, TOKENS_PER_S, MFU)
"""The keys that measure wall-clock speed: two runs of the same training differ in them only."""


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every row of ``run_dir/metrics.jsonl``, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_throughput(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their :data:`THROUGHPUT` keys: what must match between runs of the same training."""
    return [{k: v for k, v in row.items() if k not in THROUGHPUT} for row in rows]
