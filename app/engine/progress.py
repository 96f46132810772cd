"""Progress bars (training, evaluation, long data preparation) and the numbers in human messages.

On a terminal (``app.console.output.draws_bars``): while a bar is shown, console log records are written
through ``tqdm.write`` (``app.console.logs.console_records_above_bar``): the bar is cleared, the whole line printed,
the bar redrawn, so a log line never lands on the bar's line; the training bar's last line says why
training stopped, fitted to the terminal's width with whole words. Log files are left alone.
Anywhere else (a file, a pipe, a parallel sweep's job) nothing is redrawn: training progress is one
plain log line every tenth of the run, and evaluation and data-preparation bars say nothing. Shown
on the main process only (callers pass ``enabled``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from app.console.logs import console_records_above_bar
from app.console.output import draws_bars

T = TypeVar("T")
log = logging.getLogger(__name__)
PLAIN_LINES = 10
"""Plain progress lines per run where no bar is drawn (one every tenth of the planned steps)."""
MIN_BAR = 4
"""Columns the bar itself keeps when the last line is fitted to the terminal."""


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
    """One bar; a no-op when disabled (other processes, ``logging.progress_bar=false``). Where no bar
    is drawn, a bar that stays (``leave``: the training bar) logs a plain line every tenth of ``total``."""

    def __init__(self, total: int | None, initial: int = 0, enabled: bool = True, desc: str = "train",
                 unit: str = "step", leave: bool = True):
        self.bar: Any = None
        self.plain: PlainProgress | None = None
        self._redirect = contextlib.ExitStack()
        if enabled and draws_bars():
            from tqdm.std import tqdm  # type: ignore[import-untyped]

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.5, leave=leave)
            self._redirect.enter_context(console_records_above_bar(tqdm))
        elif enabled and leave and total:
            self.plain = PlainProgress(desc, total, initial, unit)

    @property
    def counts(self) -> bool:
        """Whether this progress counts steps at all (a bar, or plain lines): the loop skips
        ``update`` otherwise."""
        return self.bar is not None or self.plain is not None

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)
        elif self.plain is not None:
            self.plain.update(n)

    def show(self, loss: float, throughput: dict[str, Any], task_metrics: dict[str, float] | None = None) -> None:
        """A log step's loss and throughput (``train/samples_per_s``, ``train/tokens_per_s``, ``train/mfu``);
        the task's own training metrics (``train/<name>``) in the plain line only (a bar keeps to the loss
        and the rates, to fit a terminal's width)."""
        if self.bar is not None:
            rates = {"samples_s": f"{throughput['train/samples_per_s']:.0f}"}
            if throughput.get("train/tokens_per_s") is not None:
                rates["tokens_s"] = f"{throughput['train/tokens_per_s']:.0f}"
            if throughput.get("train/mfu") is not None:
                rates["mfu"] = f"{100 * throughput['train/mfu']:.1f}%"
            self.bar.set_postfix(loss=human(loss), **rates, refresh=False)
        elif self.plain is not None:
            own = human_metrics({k.removeprefix("train/"): v for k, v in (task_metrics or {}).items()})
            self.plain.show(f"loss={human(loss)}, {own + ', ' if own else ''}{throughput_text(throughput)}")

    def close(self, reason: str | None = None) -> None:
        """Close the bar; ``reason`` (why training stopped) replaces its postfix on the last line,
        shortened at a word to fit the terminal's width."""
        if self.bar is not None:
            if reason:
                self.bar.set_postfix_str(fitted_postfix(self.bar, f"stopped: {reason}"), refresh=False)
            self.bar.close()
            self.bar = None
        self.plain = None
        self._redirect.close()


def throughput_text(metrics: dict[str, Any], unknown_mfu: str | None = None) -> str:
    """Throughput as a log line says it: ``812 samples/s, 30512 tokens/s, MFU 41.2%`` (tokens where the
    task counts them; MFU where the device's peak is known, else ``unknown_mfu`` when given)."""
    parts = [f"{metrics['train/samples_per_s']:.0f} samples/s"]
    if metrics.get("train/tokens_per_s") is not None:
        parts.append(f"{metrics['train/tokens_per_s']:.0f} tokens/s")
    if metrics.get("train/mfu") is not None:
        parts.append(f"MFU {100 * metrics['train/mfu']:.1f}%")
    elif unknown_mfu is not None:
        parts.append(unknown_mfu)
    return ", ".join(parts)


class PlainProgress:
    """Training progress without a bar: ``train: 90/900 steps (10%), loss=0.1234, 5123 samples/s``,
    logged at the first log step (``trainer.log_every_n_steps``) of each tenth of the run, so the
    loss is that step's (no line at all when no log step comes)."""

    def __init__(self, desc: str, total: int, initial: int, unit: str):
        self.desc, self.total, self.unit, self.step = desc, total, unit, initial
        self.every = max(1, math.ceil(total / PLAIN_LINES))
        self.due_from = (initial // self.every + 1) * self.every

    def update(self, n: int) -> None:
        self.step += n

    def show(self, postfix: str) -> None:
        if self.step >= self.due_from:
            self.due_from = (self.step // self.every + 1) * self.every
            log.info("%s: %d/%d %ss (%d%%), %s", self.desc, self.step, self.total, self.unit,
                     100 * self.step // self.total, postfix)


def fitted_postfix(bar: Any, text: str) -> str:
    """``text`` as the bar's postfix, cut at a word (``…``) so that the bar's line fits its width; a
    last parenthesis (``(best 0.9694)``) is kept whole when it fits."""
    meter = bar.format_dict
    width = meter.get("ncols")
    if not width:
        return text
    # The line without the bar itself, and without any postfix: what the text has to share the width with.
    bare = bar.format_meter(**{**meter, "ncols": None, "bar_format": "{l_bar}{r_bar}", "postfix": None})
    room = width - len(bare) - MIN_BAR - len(", ")
    return fit_words(text, room)


def fit_words(text: str, width: int) -> str:
    """``text`` if it fits in ``width`` characters, else its first whole words and ``…`` (keeping a
    final parenthesis when it fits); "" when not even one word fits."""
    if len(text) <= width:
        return text
    head, tail = text, ""
    if (last := re.search(r" (\([^()]*\))$", text)) and len(last.group(1)) + 3 <= width:
        head, tail = text[:last.start()], " " + last.group(1)
    words = head.split(" ")
    while words and len(" ".join(words)) + 1 + len(tail) > width:
        words.pop()
    if not words:
        return fit_words(head, width) if tail else ""
    return f"{' '.join(words)}…{tail}"


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
