"""Start-up time of ``python -m app``, as ratios to a bare ``python -c "import torch"`` measured in the
same invocation (interleaved rounds, medians), so the machine's load affects every figure alike:

- a config refused by a rule (``trainer.batch_size=0``): answered before torch is imported;
- the first line (the run folder) of a 1-step run;
- a 1-step run on 1 process and on 2 (``hardware=multi_cpu``): to the first optimizer step, plus one
  evaluation batch and the exit (checkpoints, export, trackers, config tree and bars off).

Targets (issue 16): refused config <= 1.0x the bare import, first step <= 2x on 1 process, <= 3x on 2.

A reference row, ``plain torch step``, is the floor any PyTorch training pays before its first step:
``import torch``, an AdamW step on a small Linear, exit. torch.optim imports ``torch._dynamo`` (about
as long as torch itself) when an optimizer is made and at its first step, compiled or not.

    python bench/startup.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ONE_STEP = ("trainer.max_epochs=-1", "trainer.max_steps=1", "trainer.limit_eval_batches=1",
            "checkpoint.every_epoch=false", "checkpoint.save_final_model=false", "logging.trackers=[]",
            "logging.print_config=false", "logging.progress_bar=false")

PLAIN_STEP = ("import torch; m = torch.nn.Linear(64, 10); o = torch.optim.AdamW(m.parameters()); "
              "m(torch.randn(32, 64)).sum().backward(); o.step()")


def timed(args: list[str], cwd: Path, expect: int = 0) -> tuple[float, float | None]:
    """Seconds to exit, and to the first line on stdout (None when there is none)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    first_at = time.perf_counter() - start if first else None
    proc.stdout.read()
    code = proc.wait()
    total = time.perf_counter() - start
    if code != expect:
        raise SystemExit(f"{' '.join(args)} exited with {code}, expected {expect}")
    return total, first_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    times: dict[str, list[float]] = {k: [] for k in ("import torch", "plain torch step", "refused config",
                                                      "first line", "1 process", "2 processes")}
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for r in range(rounds):
            times["import torch"].append(timed(["-c", "import torch"], cwd)[0])
            times["plain torch step"].append(timed(["-c", PLAIN_STEP], cwd)[0])
            times["refused config"].append(
                timed(["-m", "app", "trainer.batch_size=0", f"hydra.run.dir={cwd}/bad{r}"], cwd, expect=2)[0])
            total, first = timed(["-m", "app", *ONE_STEP, f"hydra.run.dir={cwd}/one{r}"], cwd)
            times["1 process"].append(total)
            times["first line"].append(first if first is not None else float("nan"))
            times["2 processes"].append(timed(["-m", "app", *ONE_STEP, "hardware=multi_cpu",
                                               "hardware.num_processes=2", f"hydra.run.dir={cwd}/two{r}"], cwd)[0])
    base = statistics.median(times["import torch"])
    targets = {"refused config": 1.0, "1 process": 2.0, "2 processes": 3.0}
    print(f"{'':16} {'median s':>9} {'x import torch':>15} {'target':>7}   (rounds: {rounds}, load {os.getloadavg()[0]:.1f})")
    for name, values in times.items():
        median = statistics.median(values)
        target = targets.get(name)
        print(f"{name:16} {median:9.2f} {median / base:15.2f} {('<= ' + str(target)) if target else '':>7}")


if __name__ == "__main__":
    main()
