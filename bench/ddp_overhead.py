"""Multi-process cost of our runtime, in one invocation (2 CPU processes on gloo).

1. Overhead: per-step time of our DDP loop (``Accelerator.prepare`` / ``accumulate`` / ``backward`` /
   ``step``) against a plain ``torch.nn.parallel.DistributedDataParallel`` loop, same model (small
   MLP), data (the digits set), optimizer and clipping, one thread per process. The two loops run
   in the same process group, interleaved (ours, plain, plain, ours, ...); the ratio is of medians.
2. Scaling: samples/s of 2 processes against 1 process on an MLP large enough to be compute-bound
   (same global batch; 1 process gets all the cores, each of the 2 gets its share), through our
   runtime, interleaved round by round.

    python bench/ddp_overhead.py [--rounds 21] [--epochs 1] [--batch-size 32] [--big-rounds 5] [--big-steps 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BIG = (1024, 2048, 2048, 10)
BIG_GLOBAL_BATCH = 512


def digits_data() -> TensorDataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    return TensorDataset(torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target))


def mlp(sizes: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def plain_ddp(data: TensorDataset, batch_size: int, epochs: int) -> tuple[float, float]:
    """Seconds per step: wall clock, and CPU time of this process (all its threads)."""
    model = nn.parallel.DistributedDataParallel(mlp((64, 128, 64, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    steps = 0
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            steps += 1
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def ours(backend: Any, data: TensorDataset, batch_size: int, epochs: int) -> tuple[float, float]:
    from app.distributed import Accelerator

    acc = Accelerator(backend=backend, seed=0)
    model = mlp((64, 128, 64, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=batch_size, shuffle=True))
    steps = 0
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(F.cross_entropy(model(x), y))
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            steps += 1
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def overhead_worker(rounds: int, epochs: int, batch_size: int) -> dict[str, list[tuple[float, float]]]:
    from app.distributed.torch_distributed import DDPBackend

    backend = DDPBackend.from_environment(cpu=True, timeout_s=300)
    data = digits_data()
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "plain": []}
    ours(backend, data, batch_size, 1)  # warm-up: first DDP buckets, allocator
    plain_ddp(data, batch_size, 1)
    for r in range(rounds):
        order = ("ours", "plain") if r % 2 == 0 else ("plain", "ours")
        for name in order:
            t = ours(backend, data, batch_size, epochs) if name == "ours" else plain_ddp(data, batch_size, epochs)
            times[name].append(t)
    backend.shutdown()
    return times


def big_throughput(backend: Any, steps: int) -> float:
    """Samples per second (all processes together) training the big MLP through our runtime."""
    from app.distributed import Accelerator

    acc = Accelerator(backend=backend, seed=0)
    per_process = BIG_GLOBAL_BATCH // acc.num_processes
    generator = torch.Generator().manual_seed(0)
    n = BIG_GLOBAL_BATCH * (steps + 2)
    data = TensorDataset(torch.randn(n, BIG[0], generator=generator), torch.randint(0, BIG[-1], (n,), generator=generator))
    model = mlp(BIG)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=per_process))
    start = 0.0
    for i, (x, y) in enumerate(loader):
        if i == 2:  # two warm-up steps
            acc.wait_for_everyone()
            start = time.perf_counter()
        with acc.accumulate(model):
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    acc.wait_for_everyone()
    return steps * BIG_GLOBAL_BATCH / (time.perf_counter() - start)


def big_worker(steps: int) -> float:
    from app.distributed.torch_distributed import DDPBackend

    backend = DDPBackend.from_environment(cpu=True, timeout_s=300)
    try:
        return big_throughput(backend, steps)
    finally:
        backend.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--big-rounds", type=int, default=5)
    parser.add_argument("--big-steps", type=int, default=5)
    args = parser.parse_args()

    from app.distributed import Backend
    from app.launch import run_on_processes

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    print(f"{cores} cores, torch {torch.__version__}, 2 processes on gloo")

    times = run_on_processes(overhead_worker, (args.rounds, args.epochs, args.batch_size), nprocs=2)[0]
    print(f"step time, MLP 64-128-64-10, batch {args.batch_size}/process, median of {args.rounds} rounds (rank 0):")
    for i, clock in enumerate(("wall", "CPU")):
        ours_ms, plain_ms = (statistics.median(t[i] for t in times[k]) * 1e3 for k in ("ours", "plain"))
        # A round's two runs are back to back, so their ratio is little affected by load drifting
        # between rounds: on a busy machine, read the median of paired ratios.
        paired = statistics.median(o[i] / p[i] for o, p in zip(times["ours"], times["plain"]))
        print(f"  {clock:>4}: plain DDP {plain_ms:.3f} ms, ours {ours_ms:.3f} ms; ratio of medians "
              f"{ours_ms / plain_ms:.3f}, median of paired ratios {paired:.3f} (target <= 1.05)")

    torch.set_num_threads(cores)
    one, two = [], []
    for _ in range(args.big_rounds):
        one.append(big_throughput(Backend(torch.device("cpu")), args.big_steps))
        two.append(run_on_processes(big_worker, (args.big_steps,), nprocs=2)[0])
    one_s, two_s = statistics.median(one), statistics.median(two)
    sizes = "-".join(map(str, BIG))
    print(f"throughput, MLP {sizes}, global batch {BIG_GLOBAL_BATCH}, median of {len(one)} rounds:")
    print(f"  1 process ({cores} threads) {one_s:.0f} samples/s, 2 processes {two_s:.0f} samples/s, "
          f"speed-up {two_s / one_s:.2f}x")


if __name__ == "__main__":
    main()
