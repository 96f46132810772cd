"""``Accelerator.profile()`` and ``ProfileKwargs``, as Accelerate documents them: a context manager
over ``torch.profiler.profile`` whose Chrome trace goes to ``output_trace_dir`` as
``profile_<process index>.json``.

>>> kwargs = ProfileKwargs(activities=["cpu"], schedule_option={"wait": 1, "warmup": 1, "active": 2},
...                        output_trace_dir="trace")
>>> with accelerator.profile(kwargs) as prof:
...     for batch in loader:
...         train_step(batch)
...         prof.step()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

PROFILE_PATTERN_NAME = "profile_{suffix}.json"


@dataclass
class ProfileKwargs:
    """Settings of ``torch.profiler.profile`` (Accelerate's names and defaults)."""

    activities: list[str] | None = None
    """Activity groups: ``"cpu"`` and the accelerator kinds torch's profiler knows (e.g. ``"cuda"``,
    ``"xpu"``); None: torch's default (every available one)."""
    schedule_option: dict[str, int] | None = None
    """``torch.profiler.schedule`` arguments: ``wait``, ``warmup``, ``active``, ``repeat``, ``skip_first``."""
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None
    """Where the Chrome trace (``profile_<process index>.json``) is written; None: not written."""

    def _activity(self, name: str) -> torch.profiler.ProfilerActivity:
        known = {name.lower(): a for name, a in torch.profiler.ProfilerActivity.__members__.items()}
        if name.lower() not in known:
            raise ValueError(f"Invalid profiler activity: {name}. Must be one of {sorted(known)}.")
        return known[name.lower()]

    def build(self) -> torch.profiler.profile:
        activities = [self._activity(a) for a in self.activities] if self.activities is not None else None
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option is not None else None
        return torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes, profile_memory=self.profile_memory, with_stack=self.with_stack,
            with_flops=self.with_flops, with_modules=self.with_modules,
        )
