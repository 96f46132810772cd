"""Multi-process cost of our runtime, in one invocation (2 CPU processes on gloo).

1. Overhead: per-step time of our DDP loop (``Accelerator.prepare`` / ``accumulate`` / ``backward`` /
   ``step``) against the best plain ``torch.nn.parallel.DistributedDataParallel`` loop. Held equal
   (``bench/baseline.py``): the model (small MLP, same initialisation), the data (digits) and its
   order (rank r takes batch r of each global step of one permutation per epoch from ``seed +
   epoch``), torch's fused AdamW, clipping at 1.0 (over a parameter list built once), fp32, no accumulation, ``zero_grad(set_to_none=
   True)``, one thread per process, and one host read of the loss every 10 steps. Both loops run in
   the same process group, interleaved (ours, plain, plain again, plain, plain again, ours, ...); the
   ratio is of medians, and the plain loop's second run against its first is the noise floor.
2. Scaling, on an MLP large enough to be compute-bound (same global batch, SGD, through our runtime):
   speed-up of 2 processes over 1 process on the same machine (the 1 process gets every core), and
   the 2-process efficiency (samples/s on 2 processes / (2 x samples/s of 1 process)) at equal
   resources per process (one thread each).
3. FSDP2 against DDP: samples/s of the same big MLP and global batch through our FSDP2 backend and
   through our DDP backend, 2 processes, interleaved.
4. ``gather_for_metrics``: the cost it adds to one evaluation pass (a 20,000-sample set, batch 500
   per process, 10-class logits): the pass with the gather against the same pass keeping its local
   predictions only.
5. Evaluation memory per process: growth of each rank's peak RSS during the engine's ``evaluate``
   on a set whose gathered logits take 200 MB (50,000 samples x 1,000 classes), against the same
   pass keeping the gathered logits on every rank (what the engine did before).

    python bench/ddp_overhead.py [--rounds 21] [--epochs 1] [--batch-size 32] [--big-rounds 5] [--big-steps 5]
                                 [--overhead-only]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from baseline import LOG_EVERY, EpochOrder, adamw, digits_data
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

BIG = (1024, 2048, 2048, 10)
BIG_GLOBAL_BATCH = 512
SEED = 0
EVAL_SAMPLES, EVAL_BATCH, EVAL_CLASSES = 20_000, 500, 10
BIG_EVAL_SAMPLES, BIG_EVAL_CLASSES = 50_000, 1_000


def mlp(sizes: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def plain_ddp(data: TensorDataset, batch_size: int, epochs: int) -> tuple[float, float]:
    """Seconds per step: wall clock, and CPU time of this process (all its threads)."""
    model = nn.parallel.DistributedDataParallel(mlp((64, 128, 64, 10)))
    opt = adamw(model.parameters(), lr=1e-3)
    order = EpochOrder(len(data), batch_size, seed=SEED, num_processes=dist.get_world_size(),
                       process_index=dist.get_rank())
    loader = DataLoader(data, batch_sampler=order)
    steps = 0
    running = torch.zeros(())
    parameters = list(model.parameters())  # built once, as the engine does
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for epoch in range(epochs):
        order.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            running += loss.detach()
            steps += 1
            if steps % LOG_EVERY == 0:
                running.item()
                running.zero_()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def ours(backend: Any, data: TensorDataset, batch_size: int, epochs: int) -> tuple[float, float]:
    from app.distributed import Accelerator

    acc = Accelerator(backend=backend, seed=SEED)
    model = mlp((64, 128, 64, 10))
    opt = adamw(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=batch_size, shuffle=True))
    steps = 0
    running = torch.zeros(())
    parameters = list(model.parameters())  # built once, as the engine does
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(parameters, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            running += loss.detach()
            steps += 1
            if steps % LOG_EVERY == 0:
                running.item()
                running.zero_()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def same_order(backend: Any, data: TensorDataset, batch_size: int) -> bool:
    """Whether this rank's plain batches are the batches our loader gives it (two epochs)."""
    from app.distributed import Accelerator

    acc = Accelerator(backend=backend, seed=SEED)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(len(data))), batch_size=batch_size, shuffle=True))
    order = EpochOrder(len(data), batch_size, seed=SEED, num_processes=acc.num_processes,
                       process_index=acc.process_index)
    for epoch in range(2):
        loader.set_epoch(epoch)
        order.set_epoch(epoch)
        if [b[0].tolist() for b in loader] != list(order):
            return False
    return True


def ddp_backend() -> Any:
    from app.distributed.backends.torch_distributed import DDPBackend

    return DDPBackend.from_environment(timeout_s=300)


def overhead_worker(rounds: int, epochs: int, batch_size: int) -> dict[str, Any]:
    backend = ddp_backend()
    data = digits_data()
    times: dict[str, Any] = {"ours": [], "plain": [], "plain again": [],
                             "same_order": same_order(backend, data, batch_size)}
    ours(backend, data, batch_size, 1)  # warm-up: first DDP buckets, allocator
    plain_ddp(data, batch_size, 1)
    for r in range(rounds):
        # "plain again": the plain loop a second time, whose ratio to the first is the noise floor.
        order = ("ours", "plain", "plain again") if r % 2 == 0 else ("plain", "plain again", "ours")
        for name in order:
            t = ours(backend, data, batch_size, epochs) if name == "ours" else plain_ddp(data, batch_size, epochs)
            times[name].append(t)
    backend.shutdown()
    return times


def big_throughput(backend: Any, steps: int) -> float:
    """Samples per second (all processes together) training the big MLP through our runtime."""
    from app.distributed import Accelerator

    acc = Accelerator(backend=backend, seed=SEED)
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
            opt.zero_grad(set_to_none=True)
    acc.wait_for_everyone()
    return steps * BIG_GLOBAL_BATCH / (time.perf_counter() - start)


def one_process_throughput(steps: int, threads: int) -> float:
    from app.distributed import Backend

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return big_throughput(Backend(torch.device("cpu")), steps)
    finally:
        torch.set_num_threads(before)


def big_worker(steps: int) -> float:
    backend = ddp_backend()
    try:
        return big_throughput(backend, steps)
    finally:
        backend.shutdown()


def fsdp_vs_ddp_worker(steps: int, rounds: int) -> dict[str, list[float]]:
    """Samples/s of the big MLP through FSDP2 and through DDP, interleaved, in one process group."""
    from app.distributed.backends.torch_distributed import DDPBackend, FSDPBackend

    ddp = DDPBackend.from_environment(timeout_s=300)
    # The group exists now: the FSDP2 backend joins it instead of creating another.
    fsdp = FSDPBackend.from_environment(timeout_s=300)
    out: dict[str, list[float]] = {"ddp": [], "fsdp": []}
    for r in range(rounds):
        for name in (("ddp", "fsdp") if r % 2 == 0 else ("fsdp", "ddp")):
            out[name].append(big_throughput(ddp if name == "ddp" else fsdp, steps))
    ddp.shutdown()
    return out


def gather_cost_worker(rounds: int) -> dict[str, list[float]]:
    """Seconds per evaluation pass: predictions gathered with gather_for_metrics vs kept local."""
    from app.distributed import Accelerator

    backend = ddp_backend()
    acc = Accelerator(backend=backend, seed=SEED)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(EVAL_SAMPLES, 64, generator=generator),
                         torch.randint(0, EVAL_CLASSES, (EVAL_SAMPLES,), generator=generator))
    model = acc.prepare(mlp((64, 128, EVAL_CLASSES)))
    loader = acc.prepare(DataLoader(data, batch_size=EVAL_BATCH))
    model.eval()

    @torch.no_grad()
    def evaluation(gather: bool) -> float:
        acc.wait_for_everyone()
        start = time.perf_counter()
        kept = []
        for x, y in loader:
            logits = model(x)
            kept.append(acc.gather_for_metrics((logits, y)) if gather else (logits, y))
        torch.cat([k[0] for k in kept]).argmax(-1)
        acc.wait_for_everyone()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"local": [], "gathered": []}
    evaluation(True)
    for r in range(rounds):
        for gather in ((False, True) if r % 2 == 0 else (True, False)):
            times["gathered" if gather else "local"].append(evaluation(gather))
    backend.shutdown()
    return times


class _ClassifierTask:
    """The smallest task ``evaluate`` needs: logits of a linear classifier, and accuracy."""

    name = "bench"

    def step(self, model: nn.Module, batch: Any) -> Any:
        from app.tasks.base import StepOutput

        x, y = batch
        logits = model(x)
        return StepOutput(loss=logits.new_zeros(()), logits=logits, labels=y)

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        return {"accuracy": float((logits.argmax(-1) == labels).float().mean())}


def eval_memory_worker(keep_on_every_rank: bool) -> float:
    """MiB by which this rank's peak RSS grew during one evaluation pass."""
    import resource

    from app.distributed import Accelerator
    from app.engine.loop import Components, evaluate

    backend = ddp_backend()
    acc = Accelerator(backend=backend, seed=SEED)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BIG_EVAL_SAMPLES, 16, generator=generator),
                         torch.randint(0, BIG_EVAL_CLASSES, (BIG_EVAL_SAMPLES,), generator=generator))
    model = acc.prepare(nn.Linear(16, BIG_EVAL_CLASSES))
    loader = acc.prepare(DataLoader(data, batch_size=EVAL_BATCH))
    task = _ClassifierTask()
    with torch.no_grad():  # warm-up: allocator, first gathers
        for i, (x, y) in enumerate(loader):
            acc.gather_for_metrics((model(x), y))
            if i == 2:
                break
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if keep_on_every_rank:
        with torch.no_grad():
            kept = [acc.gather_for_metrics((model(x), y)) for x, y in loader]
            task.compute_metrics(torch.cat([k[0] for k in kept]), torch.cat([k[1] for k in kept]))
    else:
        evaluate(Components(acc, task, model, None, None, None, loader))  # type: ignore[arg-type]
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    backend.shutdown()
    return grown


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--big-rounds", type=int, default=5)
    parser.add_argument("--big-steps", type=int, default=5)
    parser.add_argument("--overhead-only", action="store_true", help="part 1 only (the per-step overhead)")
    args = parser.parse_args()

    from app.this_process import available_cores
    from app.workers.processes import run_on_processes

    cores = available_cores()
    print(f"{cores} cores, torch {torch.__version__}, 2 processes on gloo")

    times = run_on_processes(overhead_worker, (args.rounds, args.epochs, args.batch_size), nprocs=2)[0]
    if not times["same_order"]:
        raise SystemExit("ddp_overhead: the plain loop's data order differs from ours; fix bench/baseline.py.")
    print(f"step time, MLP 64-128-64-10, batch {args.batch_size}/process, median of {args.rounds} rounds (rank 0):")
    for i, clock in enumerate(("wall", "CPU")):
        ours_ms, plain_ms = (statistics.median(t[i] for t in times[k]) * 1e3 for k in ("ours", "plain"))
        # A round's two runs are back to back, so their ratio is little affected by load drifting
        # between rounds: on a busy machine, read the median of paired ratios.
        paired = statistics.median(o[i] / p[i] for o, p in zip(times["ours"], times["plain"]))
        floor = statistics.median(a[i] / p[i] for a, p in zip(times["plain again"], times["plain"]))
        print(f"  {clock:>4}: plain DDP {plain_ms:.3f} ms, ours {ours_ms:.3f} ms; ratio of medians "
              f"{ours_ms / plain_ms:.3f}, median of paired ratios {paired:.3f} (target <= 1.01); "
              f"noise floor (plain again / plain) {floor:.3f}")
    if args.overhead_only:
        return

    one_all, one_single, two = [], [], []
    for _ in range(args.big_rounds):
        one_all.append(one_process_throughput(args.big_steps, cores))
        one_single.append(one_process_throughput(args.big_steps, 1))
        two.append(run_on_processes(big_worker, (args.big_steps,), nprocs=2)[0])
    one_s, single_s, two_s = statistics.median(one_all), statistics.median(one_single), statistics.median(two)
    sizes = "-".join(map(str, BIG))
    print(f"scaling, MLP {sizes}, global batch {BIG_GLOBAL_BATCH}, SGD, median of {len(two)} rounds:")
    print(f"  1 process x {cores} threads {one_s:.0f} samples/s, 2 processes x 1 thread {two_s:.0f} samples/s: "
          f"speed-up {two_s / one_s:.2f}x on the same machine")
    print(f"  1 process x 1 thread {single_s:.0f} samples/s: 2-process efficiency "
          f"{two_s / (2 * single_s):.2f} (samples/s on 2 / (2 x on 1), one thread per process)")

    fsdp = run_on_processes(fsdp_vs_ddp_worker, (args.big_steps, args.big_rounds), nprocs=2)[0]
    ddp_s, fsdp_s = statistics.median(fsdp["ddp"]), statistics.median(fsdp["fsdp"])
    print(f"FSDP2 vs DDP, same MLP and global batch, 2 processes, median of {args.big_rounds} rounds:")
    print(f"  DDP {ddp_s:.0f} samples/s, FSDP2 {fsdp_s:.0f} samples/s: FSDP2 / DDP {fsdp_s / ddp_s:.2f}")

    cost = run_on_processes(gather_cost_worker, (args.rounds,), nprocs=2)[0]
    local_ms, gathered_ms = (statistics.median(cost[k]) * 1e3 for k in ("local", "gathered"))
    steps = -(-EVAL_SAMPLES // (2 * EVAL_BATCH))
    print(f"gather_for_metrics, {EVAL_SAMPLES} samples, {EVAL_CLASSES}-class logits, batch {EVAL_BATCH}/process "
          f"({steps} gathers), median of {args.rounds} rounds:")
    print(f"  evaluation pass {local_ms:.1f} ms local, {gathered_ms:.1f} ms gathered: "
          f"+{gathered_ms - local_ms:.1f} ms per evaluation ({gathered_ms / local_ms:.2f}x)")

    engine = run_on_processes(eval_memory_worker, (False,), nprocs=2)
    every_rank = run_on_processes(eval_memory_worker, (True,), nprocs=2)
    size_mb = BIG_EVAL_SAMPLES * BIG_EVAL_CLASSES * 4 / 1e6
    print(f"evaluation memory, {BIG_EVAL_SAMPLES} samples x {BIG_EVAL_CLASSES} classes ({size_mb:.0f} MB of "
          "gathered logits), peak RSS growth per rank:")
    print(f"  engine's evaluate: rank 0 +{engine[0]:.0f} MiB, rank 1 +{engine[1]:.0f} MiB; "
          f"kept on every rank: rank 0 +{every_rank[0]:.0f} MiB, rank 1 +{every_rank[1]:.0f} MiB")


if __name__ == "__main__":
    main()
