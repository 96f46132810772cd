"""How many intra-op threads torch should use per process (``app/engine/threads.py``'s rule), measured
as ratios in one invocation under three conditions (the load average is printed with each):

- **idle**: as near an idle machine as a shared one gets: this process (and the jobs it starts) at the
  highest priority, ``nice -20``, over the machine's other work (needs root; skipped otherwise);
- **as is**: the machine as it is, at normal priority;
- **loaded**: as is, plus one busy process per core started by this script.

In each:

- **step**: the median training step (forward, backward, AdamW) of MLPs from the default job's size
  (17 k parameters) up to a few million, batch 32, with all the process's cores vs one thread
  (interleaved rounds, so a change in the machine's load affects both alike). A ratio above 1 means
  one thread is faster.
- **job**: the default job (``python -m app``, checkpoints, trackers, bars and config tree off) with
  the app's choice vs ``hardware.num_threads=<cores>`` (torch's own default: every core), wall time
  to exit.

    python bench/threads.py [--rounds 3] [--steps 40] [--no-job]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.this_process import available_cores

# (hidden sizes) of a 64-input, 10-class MLP, as the digits task builds it.
SIZES = ((128, 64), (512, 256), (1024, 1024), (2048, 2048))
JOB = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false",
       "checkpoint.every_epoch=false", "checkpoint.save_final_model=false")


def mlp(hidden: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    width = 64
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    return nn.Sequential(*layers, nn.Linear(width, 10))


def step_time(model: nn.Module, threads: int, steps: int) -> float:
    """Median seconds per training step with ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    times = []
    for i in range(steps + 5):
        started = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 5:  # warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def job_time(args: tuple[str, ...], cwd: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "app", *JOB, *args, f"hydra.run.dir={cwd / str(time.monotonic_ns())}"],
                   cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


@contextmanager
def busy(processes: int) -> Iterator[None]:
    """``processes`` busy loops (one per core: the machine "loaded"), ended by their pids."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        time.sleep(1.0)
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-job", action="store_true", help="skip the default job's wall times")
    args = parser.parse_args()
    cores = available_cores()
    print(f"{cores} cores; load average {os.getloadavg()[0]:.1f} at start; rounds {args.rounds}")
    for condition in ("idle", "as is", "loaded"):
        if condition == "idle" and os.geteuid() != 0:
            print("\nidle: skipped (nice -20 needs root)")
            continue
        os.setpriority(os.PRIO_PROCESS, 0, -20 if condition == "idle" else 0)
        with busy(cores if condition == "loaded" else 0):
            print(f"\n{condition} (load average {os.getloadavg()[0]:.1f}): step time, {cores} threads / 1 thread")
            for hidden in SIZES:
                model = mlp(hidden)
                params = sum(p.numel() for p in model.parameters())
                many, one = [], []
                for _ in range(args.rounds):
                    one.append(step_time(model, 1, args.steps))
                    many.append(step_time(model, cores, args.steps))
                ratio = statistics.median(m / o for m, o in zip(many, one, strict=True))
                print(f"  MLP {hidden}: {params:>10,} parameters: {ratio:.2f}x "
                      f"({statistics.median(many) * 1e3:.2f} vs {statistics.median(one) * 1e3:.2f} ms)")
            if args.no_job:
                continue
            with tempfile.TemporaryDirectory() as folder:
                chosen, every = [], []
                for _ in range(args.rounds):
                    chosen.append(job_time((), Path(folder)))
                    every.append(job_time((f"hardware.num_threads={cores}",), Path(folder)))
                print(f"  default job, the app's choice / {cores} threads: "
                      f"{statistics.median(c / e for c, e in zip(chosen, every, strict=True)):.2f}x "
                      f"({statistics.median(chosen):.1f} vs {statistics.median(every):.1f} s)")


if __name__ == "__main__":
    main()
