"""Our XLA step against PyTorch/XLA's own recipe, in one invocation on XLA's CPU device:

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 .venv-xla/bin/python bench/xla_step.py [--steps 200] [--warmup 30]

Five loops train the same MLP on the same batches (AdamW, clipping at 1.0, the loss summed on the
device inside the step and read every 10 steps), each from a fresh model:

- ``ours``: an ``Accelerator`` on ``hardware=tpu``'s SPMD backend with a prepared DataLoader (batches
  loaded and sharded two steps ahead by its prefetch thread; the optimizer step cuts the graph);
- ``ours, read late``: the same, the log read started with ``Accelerator.read_async`` and its result
  asked after the next step, as the engine logs;
- ``ours, no prefetch``: the same with the backend's ``prefetch_depth`` set to 0;
- ``hand, sync``: the loop torch_xla's documentation writes, ``MpDeviceLoader`` with SPMD
  ``input_sharding`` and ``torch_xla.sync()`` after the optimizer step;
- ``hand, compile``: the same step inside ``torch_xla.compile``.

Prints each loop's median step time after warm-up and the graphs it compiled after warm-up (must be
0), then the ratios: hand / ours (goal >= 0.98: ours as fast as the hand loop), reading the log a
step later / at once (mean step times: only every tenth step reads), prefetch on / off, compile / sync. Then time to the first step of two fresh processes sharing a new compile cache
(``--first-step`` children): the first fills it, the second finds its graphs there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from app.distributed import Accelerator
from app.distributed.backends.xla_metrics import XlaCounts
from app.distributed.backends.xla_spmd import XlaSpmdBackend

LOG_EVERY = 10
BATCH = 64


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def dataset(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(steps * BATCH, 64, generator=g), torch.randint(0, 10, (steps * BATCH,), generator=g))


def as_dict(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """MpDeviceLoader's ``input_sharding`` takes one spec per key of a dict batch."""
    return {"x": torch.stack([s[0] for s in samples]), "y": torch.stack([s[1] for s in samples])}


class LossSum:
    """The loss summed on the device inside the step, before its graph is cut (as the engine sums it)."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def add(self, loss: torch.Tensor) -> None:
        self.total = loss.detach() if self.total is None else self.total + loss.detach()

    def take(self) -> torch.Tensor:
        total, self.total = self.total, None
        assert total is not None
        return total


class Loop:
    """One way to train: ``step(batch)`` over its own batches, the loss summed on the device and read
    every LOG_EVERY steps, at once or (``read_later``, the engine's way: ``Accelerator.read_async``)
    after the next step; :meth:`run` does ``n`` steps and keeps their times after warm-up."""

    def __init__(self, batches: Iterable[Any], step: Callable[[Any], None], losses: LossSum, warmup: int,
                 read_later: Callable[..., Any] | None = None):
        self.batches, self.step, self.losses, self.warmup = iter(batches), step, losses, warmup
        self.read_later, self.reading = read_later, None
        self.done, self.times = 0, []
        self.graphs_after_warmup = 0

    def run(self, n: int) -> None:
        before, warm = XlaCounts.now(), self.done >= self.warmup
        last = time.perf_counter()
        for _ in range(n):
            self.step(next(self.batches))
            self.done += 1
            if self.reading is not None:  # the previous log point's read, complete by now
                self.reading.result()
                self.reading = None
            if self.done % LOG_EVERY == 0:  # the log point: the one host read
                if self.read_later is None:
                    self.losses.take().item()
                else:
                    self.reading = self.read_later(self.losses.take())
            now = time.perf_counter()
            if self.done > self.warmup:
                self.times.append(now - last)
            last = now
        if warm:  # only this loop ran since ``before``: the graphs are its own
            self.graphs_after_warmup += XlaCounts.now().since(before).compiles


def ours(data: TensorDataset, warmup: int, prefetch: int, read_later: bool = False) -> Loop:
    backend = XlaSpmdBackend()
    backend.prefetch_depth = prefetch
    acc = Accelerator(backend=backend, seed=0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=BATCH, collate_fn=as_dict))
    losses = LossSum()

    def step(batch: dict[str, torch.Tensor]) -> None:
        loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        acc.backward(loss)
        losses.add(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()  # cuts the graph (the backend's end-of-step hook)
        optimizer.zero_grad()

    return Loop(loader, step, losses, warmup, acc.read_async if read_later else None)


def hand(data: TensorDataset, warmup: int, compiled: bool, mesh: Any) -> Loop:
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs

    device = torch_xla.device()
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sharding = {"x": xs.ShardingSpec(mesh, ("data", None)), "y": xs.ShardingSpec(mesh, ("data",))}
    loader = pl.MpDeviceLoader(DataLoader(data, batch_size=BATCH, collate_fn=as_dict), device, input_sharding=sharding)
    losses = LossSum()

    def step_body(batch: dict[str, torch.Tensor]) -> None:
        loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        losses.add(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    if compiled:
        step = torch_xla.compile(step_body)
    else:
        def step(batch: dict[str, torch.Tensor]) -> None:
            step_body(batch)
            torch_xla.sync()

    return Loop(loader, step, losses, warmup)


def first_step(cache: Path) -> None:
    """Child mode: the backend with the compile cache ``cache``, one training step, then exit."""
    backend = XlaSpmdBackend(compile_cache_dir=cache)
    acc = Accelerator(backend=backend, seed=0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    x, y = backend.place_batch(tuple(dataset(1).tensors))
    loss = nn.functional.cross_entropy(model(x), y)
    acc.backward(loss)
    optimizer.step()
    loss.item()
    print(backend.runtime_report())


def time_to_first_step(cache: Path) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--first-step", str(cache)], capture_output=True, text=True,
                          check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    return time.perf_counter() - start, proc.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30, help="a multiple of 10")
    parser.add_argument("--first-step", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_step is not None:
        first_step(args.first_step)
        return
    data = dataset(args.steps)
    mesh = XlaSpmdBackend().mesh
    loops = {
        "ours": ours(data, args.warmup, prefetch=2),
        "ours, read late": ours(data, args.warmup, prefetch=2, read_later=True),
        "ours, no prefetch": ours(data, args.warmup, prefetch=0),
        "hand, sync": hand(data, args.warmup, compiled=False, mesh=mesh),
        "hand, compile": hand(data, args.warmup, compiled=True, mesh=mesh),
    }
    # Interleaved, LOG_EVERY steps of each in turn (each turn ends at a host read, or with one read
    # late, whose step has run by the next turn): the machine's load changes alike for all five.
    import torch_xla.core.xla_model as xm

    for _ in range(args.steps // LOG_EVERY):
        for loop in loops.values():
            loop.run(LOG_EVERY)
            xm.wait_device_ops()  # nothing of this loop still runs when the next one starts
    results = {name: (statistics.median(loop.times), statistics.mean(loop.times), loop.graphs_after_warmup)
               for name, loop in loops.items()}
    print(f"MLP 64-512-512-10, batch {BATCH} over {len(mesh.device_ids)} XLA devices, {args.steps} steps "
          f"({args.warmup} warm-up), AdamW, clipping, a host read every {LOG_EVERY} steps")
    for name, (median, mean, graphs) in results.items():
        print(f"  {name:<18} {median * 1e3:7.3f} ms/step (median), {mean * 1e3:7.3f} (mean), {graphs} graph(s) "
              f"compiled after warm-up")
    fastest_hand = min(results["hand, sync"][0], results["hand, compile"][0])
    print(f"speed ours / hand-written (faster of sync, compile): {fastest_hand / results['ours'][0]:.3f} (goal >= 0.98)")
    print(f"speed with the log read a step later / at once (means: a log step is 1 in {LOG_EVERY}): "
          f"{results['ours'][1] / results['ours, read late'][1]:.3f}")
    print(f"speed prefetch on / off: {results['ours, no prefetch'][0] / results['ours'][0]:.3f}")
    print(f"speed torch_xla.compile / sync (hand loop): {results['hand, sync'][0] / results['hand, compile'][0]:.3f}")
    with tempfile.TemporaryDirectory() as folder:
        first, first_report = time_to_first_step(Path(folder))
        second, second_report = time_to_first_step(Path(folder))
    print(f"time to the first step, fresh process: {first:.1f} s with an empty compile cache, {second:.1f} s with "
          f"the first one's (ratio {second / first:.2f})")
    print(f"  first:  {first_report}\n  second: {second_report}")


if __name__ == "__main__":
    main()
