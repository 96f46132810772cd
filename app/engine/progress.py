"""The progress bar: one, on the main process, showing step, loss and throughput."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.5)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def show(self, loss: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
