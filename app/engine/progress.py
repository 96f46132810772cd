"""Progress bars (training, evaluation, long data preparation) and the numbers in human messages.

While a bar is shown, console log records are written through ``tqdm.write`` (tqdm's
``logging_redirect_tqdm``): the bar is cleared, the whole line printed, the bar redrawn, so a log line
never lands on the bar's line. Log files are left alone. Bars are shown on the main process only
(callers pass ``enabled``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def human(value: Any) -> str:
    """A metric as people read it: 4 decimals for floats (``0.9694``), integers as integers."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e6 else f"{value:.3g}"
    return str(value)


def human_metrics(metrics: dict[str, Any], prefix: str = "") -> str:
    return ", ".join(f"{k}={human(v)}" for k, v in metrics.items() if k.startswith(prefix))


class Progress:
    """One bar; a no-op when disabled (other processes, ``logging.progress_bar=false``)."""

    def __init__(self, total: int | None, initial: int = 0, enabled: bool = True, desc: str = "train",
                 unit: str = "step", leave: bool = True):
        self.bar: Any = None
        self._redirect = contextlib.ExitStack()
        if enabled:
            from tqdm.contrib.logging import logging_redirect_tqdm  # type: ignore[import-untyped]
            from tqdm.std import tqdm  # type: ignore[import-untyped]

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.5, leave=leave)
            self._redirect.enter_context(logging_redirect_tqdm(tqdm_class=tqdm))

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def show(self, loss: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=human(loss), samples_s=f"{samples_per_s:.0f}", refresh=False)

    def close(self, reason: str | None = None) -> None:
        """Close the bar; ``reason`` (why training stopped) replaces its postfix on the last line."""
        if self.bar is not None:
            if reason:
                self.bar.set_postfix_str(f"stopped: {reason}", refresh=False)
            self.bar.close()
            self.bar = None
        self._redirect.close()


def with_progress(items: Iterable[T], enabled: bool, desc: str, total: int | None = None,
                  unit: str = "batch") -> Iterator[T]:
    """Iterate ``items`` behind a transient bar (evaluation, tokenization); plain iteration when disabled."""
    if not enabled:
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    progress = Progress(total, enabled=True, desc=desc, unit=unit, leave=False)
    try:
        for item in items:
            yield item
            progress.update()
    finally:
        progress.close()
