"""Per-step overhead of our runtime and engine against a plain PyTorch loop, in one invocation.

Same model (small MLP), same data (the digits set), same optimizer and schedule, one CPU thread.
Runs are interleaved (plain, runtime, engine, plain, ...) and timed in process CPU time (a noisy
neighbour on a shared VM steals wall time, not CPU time); each variant's per-step time is the
median over rounds, so drift in machine load affects all variants alike. Prints the ratios.

    python bench/step_overhead.py [--rounds 21] [--epochs 2] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


def digits_data() -> TensorDataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    return TensorDataset(torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def make_opt(model: nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def plain_loop(data: TensorDataset, batch_size: int, epochs: int) -> tuple[float, int]:
    model = make_model()
    opt, sched = make_opt(model)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    steps = 0
    start = time.process_time()
    for _ in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            steps += 1
    return time.process_time() - start, steps


def runtime_loop(data: TensorDataset, batch_size: int, epochs: int) -> tuple[float, int]:
    from app.distributed import Accelerator

    acc = Accelerator(cpu=True)
    model = make_model()
    opt, sched = make_opt(model)
    model, opt, loader, sched = acc.prepare(model, opt, DataLoader(data, batch_size=batch_size, shuffle=True), sched)
    steps = 0
    start = time.process_time()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            steps += 1
    return time.process_time() - start, steps


def engine_loop(data: TensorDataset, batch_size: int, epochs: int) -> tuple[float, int]:
    """The application's own loop (``app.engine.loop.fit``) on the same model and data. Time spent in
    evaluation (once per epoch, on a one-sample set) is measured and subtracted, so what remains is
    the training steps plus the loop's own bookkeeping (logging, triggers, progress)."""
    import tempfile
    from pathlib import Path

    import app.engine.loop as loop_module
    from app.config import (
        AdamWConfig,
        EarlyStoppingConfig,
        LoggingConfig,
        RunConfig,
        SchedulerConfig,
        TrainerConfig,
    )
    from app.engine.build import build_accelerator, build_components, build_early_stopping
    from app.engine.loop import LoopState, fit
    from app.tasks.base import TaskData
    from app.tasks.digits import DigitsTask
    from app.tasks.digits_config import DigitsConfig

    class BenchTask(DigitsTask):
        def build_data(self, runtime):
            return TaskData(train=data, eval=TensorDataset(data.tensors[0][:1], data.tensors[1][:1]))

        def build_model(self):
            return make_model()

    cfg = RunConfig(task=DigitsConfig(), optim=AdamWConfig(lr=1e-3),
                    scheduler=SchedulerConfig(_target_="app.engine.schedulers.constant_with_warmup"),
                    trainer=TrainerConfig(max_epochs=epochs, batch_size=batch_size, max_grad_norm=1.0,
                                          log_every_n_steps=10),
                    early_stopping=EarlyStoppingConfig(patience=None),
                    logging=LoggingConfig(trackers=[], progress_bar=False))
    with tempfile.TemporaryDirectory() as tmp:
        acc = build_accelerator(cfg, Path(tmp))
        components = build_components(cfg, acc, BenchTask(cfg.task))
        state = LoopState()
        evaluate = loop_module.evaluate
        eval_time = 0.0

        def timed_evaluate(c):
            nonlocal eval_time
            t0 = time.process_time()
            result = evaluate(c)
            eval_time += time.process_time() - t0
            return result

        loop_module.evaluate = timed_evaluate
        try:
            start = time.process_time()
            fit(components, cfg, state, build_early_stopping(cfg))
            elapsed = time.process_time() - start - eval_time
        finally:
            loop_module.evaluate = evaluate
        acc.end_training()
    return elapsed, state.global_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = digits_data()
    variants = {"plain": plain_loop, "runtime": runtime_loop, "engine": engine_loop}
    for fn in variants.values():  # warm-up: imports, allocator, first-call costs
        fn(data, args.batch_size, 1)
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            elapsed, steps = fn(data, args.batch_size, args.epochs)
            per_step[name].append(elapsed / steps)
    med = {name: statistics.median(v) for name, v in per_step.items()}
    # Each round's ratio compares runs made seconds apart, so slow drift of the machine cancels;
    # the median over rounds then discards the rounds a noisy neighbour disturbed.
    paired = {name: statistics.median(a / b for a, b in zip(per_step[name], per_step["plain"])) for name in variants}
    print(f"MLP 64-128-64-10, digits, batch {args.batch_size}, 1 thread, {args.rounds} rounds x {args.epochs} epochs")
    for name in variants:
        print(f"  {name:8s} {med[name] * 1e6:8.1f} us/step (median)   ratio to plain: "
              f"{med[name] / med['plain']:.3f} of medians, {paired[name]:.3f} median of paired rounds")


if __name__ == "__main__":
    main()
