"""Writes ``prompts.jsonl``: single-digit additions as chat prompts, each with its answer in an ``answer`` column
(which the rewards read by name). Offline and seeded: ``python make_prompts.py`` writes the same file again."""

from __future__ import annotations

import json
import random
from pathlib import Path


def rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    return [{"prompt": [{"role": "user", "content": f"{a} + {b} ="}], "answer": str(a + b)} for a, b in pairs * 3]


if __name__ == "__main__":
    out = Path(__file__).with_name("prompts.jsonl")
    out.write_text("".join(json.dumps(row) + "\n" for row in rows()), encoding="utf-8")
    print(f"wrote {out}")
