"""How many intra-op threads torch uses in this process (``hardware.num_threads``; null: chosen here).

torch's default is one thread per core. For a small model that is the slowest choice, and beside other
work it is slow for any model: every op waits at a barrier for all its threads, and a thread the
machine's other work has descheduled holds up the rest. ``bench/threads.py`` on 2 cores shared with
other work (load average 9-13): a training step of an MLP of 17 k to 4.3 M parameters is 2.8-57x
slower on 2 threads than on 1, at top priority (``nice -20``) and at normal priority alike; the
default job takes 0.20x the time on 1 thread. The rule, per process:

1. ``hardware.num_threads``, when set;
2. else a model under :data:`SMALL_MODEL` parameters: one thread, the fastest both at top priority and
   beside other work (``bench/threads.py``);
3. else the cores this process owns: those it may run on (its affinity mask), shared among the run's
   processes on this machine (``LOCAL_WORLD_SIZE``);
4. and never more than ``OMP_NUM_THREADS`` when that is set: a cap set by the user or a launcher
   (torchrun sets 1 for several processes per machine, joblib's workers get their share of the cores).

The choice is logged in the model summary (``app.engine.summary``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from app.this_process import available_cores, local_world_size

SMALL_MODEL = 5_000_000
"""Parameters below which one thread is used: the largest MLP measured (4.3 M) was fastest on one thread
in every condition ``bench/threads.py`` could produce. (An idle many-core machine was not available to
measure; larger models get the cores they own.)"""


@dataclass(frozen=True)
class ThreadChoice:
    count: int
    reason: str

    def __str__(self) -> str:
        return f"{self.count} thread{'' if self.count == 1 else 's'} ({self.reason})"


def choose_threads(num_threads: int | None, parameters: int, environ: Mapping[str, str] = os.environ,
                   cores: int | None = None) -> ThreadChoice:
    """The intra-op threads for a process training a model of ``parameters`` (the rule above)."""
    if num_threads is not None:
        return ThreadChoice(num_threads, "hardware.num_threads")
    if parameters < SMALL_MODEL:
        choice = ThreadChoice(1, "small model")
    else:
        local = max(1, local_world_size(environ=environ))
        owned = max(1, (available_cores() if cores is None else cores) // local)
        choice = ThreadChoice(owned, f"the {'core' if owned == 1 else f'{owned} cores'} this process owns")
    cap = environ.get("OMP_NUM_THREADS", "").strip()
    if cap.isdigit() and 0 < int(cap) < choice.count:
        return ThreadChoice(int(cap), "OMP_NUM_THREADS")
    return choice


def use_threads(choice: ThreadChoice) -> None:
    """Apply ``choice`` to this process (torch's intra-op pool; the process keeps it)."""
    if torch.get_num_threads() != choice.count:
        torch.set_num_threads(choice.count)
