"""Per-step overhead of our runtime and engine against the best plain PyTorch loop, in one invocation.

Held equal across the three variants (see ``bench/baseline.py``): the model (small MLP, same
initialisation), the data (the digits set) in the same order (one permutation per epoch from
``seed + epoch``), the optimizer (torch's fused AdamW, the one the engine picks, with the engine's
parameter groups: no decay on biases), a constant LR schedule stepped every step, clipping at 1.0
(over a parameter list built once, as the engine does),
fp32, no accumulation, ``zero_grad(set_to_none=True)``, one CPU thread, and one host read of the loss
every 10 steps (the engine logs it that often; the plain loops read it too, and never sync otherwise).

Runs are interleaved (plain, runtime, engine, plain again, plain, ...) and timed in process CPU time
(a noisy neighbour on a shared VM steals wall time, not CPU time); each variant's per-step time is
the median over rounds, so drift in machine load affects all variants alike. Prints the ratios, and
the plain loop's second run against its first: the noise floor of those ratios.

``--count-bytecodes`` counts instead the Python bytecodes each variant executes per optimizer step
(``sys.settrace`` opcode events; a run of 3 epochs minus a run of 1, so setup cancels; evaluation
excluded). At this model size a step is mostly Python (torch's and ours), and the count is the same
on an idle and on a loaded machine: the per-step work we add, measured exactly, when timings are
too noisy to resolve a few per cent.

    python bench/step_overhead.py [--rounds 21] [--epochs 2] [--batch-size 32] [--count-bytecodes]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

# numpy's OpenBLAS keeps a thread spinning for a while after any BLAS call (here: while the data is
# loaded); its CPU time is this process's, so it would land in whichever loop runs then. The loops
# themselves use torch's own BLAS, on one thread.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch
from baseline import LOG_EVERY, EpochOrder, adamw, digits_data
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from app.engine.parameter_groups import parameter_groups

SEED = 0
WEIGHT_DECAY = 0.01


class BytecodeCounter:
    """Counts the Python bytecodes executed inside ``counting()``, except inside ``paused()``."""

    def __init__(self) -> None:
        self.count = 0
        self._paused = False

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return self._opcode

    def _opcode(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and not self._paused:
            self.count += 1
        return self._opcode

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        sys.settrace(self._call)
        try:
            yield
        finally:
            sys.settrace(None)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused = True
        try:
            yield
        finally:
            self._paused = False


COUNTER: BytecodeCounter | None = None
"""Set while ``--count-bytecodes`` counts (the engine's evaluation pauses it)."""


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def make_opt(model: nn.Module):
    opt = adamw(parameter_groups(model, WEIGHT_DECAY), lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def plain_loop(data: TensorDataset, batch_size: int, epochs: int) -> tuple[float, int]:
    model = make_model()
    opt, sched = make_opt(model)
    order = EpochOrder(len(data), batch_size, seed=SEED)
    loader = DataLoader(data, batch_sampler=order)
    steps = 0
    running = torch.zeros(())
    start = time.process_time()
    parameters = list(model.parameters())
    for epoch in range(epochs):
        order.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            running += loss.detach()
            steps += 1
            if steps % LOG_EVERY == 0:
                running.item()
                running.zero_()
    return time.process_time() - start, steps


def runtime_loop(data: TensorDataset, batch_size: int, epochs: int) -> tuple[float, int]:
    from app.distributed import Accelerator

    acc = Accelerator(cpu=True, seed=SEED)
    model = make_model()
    opt, sched = make_opt(model)
    model, opt, loader, sched = acc.prepare(model, opt, DataLoader(data, batch_size=batch_size, shuffle=True), sched)
    steps = 0
    running = torch.zeros(())
    start = time.process_time()
    parameters = list(model.parameters())
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(parameters, 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            running += loss.detach()
            steps += 1
            if steps % LOG_EVERY == 0:
                running.item()
                running.zero_()
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
    from app.tasks.digits.config import DigitsConfig
    from app.tasks.digits.task import DigitsTask

    class BenchTask(DigitsTask):
        def build_data(self, runtime):
            return TaskData(train=data, eval=TensorDataset(data.tensors[0][:1], data.tensors[1][:1]))

        def build_model(self):
            return make_model()

    cfg = RunConfig(task=DigitsConfig(), optim=AdamWConfig(lr=1e-3, weight_decay=WEIGHT_DECAY, fused=True),
                    seed=SEED,
                    scheduler=SchedulerConfig(_target_="app.engine.schedulers.constant_with_warmup"),
                    trainer=TrainerConfig(max_epochs=epochs, batch_size=batch_size, max_grad_norm=1.0,
                                          log_every_n_steps=LOG_EVERY),
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
            with COUNTER.paused() if COUNTER is not None else contextlib.nullcontext():
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


def assert_same_order(data: TensorDataset, batch_size: int) -> None:
    """The plain loop's batches are our loader's batches, epoch by epoch (what "same data" means)."""
    from app.distributed import Accelerator

    acc = Accelerator(cpu=True, seed=SEED)
    ours = acc.prepare(DataLoader(TensorDataset(torch.arange(len(data))), batch_size=batch_size, shuffle=True))
    order = EpochOrder(len(data), batch_size, seed=SEED)
    for epoch in range(2):
        ours.set_epoch(epoch)
        order.set_epoch(epoch)
        if [b[0].tolist() for b in ours] != list(order):
            raise SystemExit("step_overhead: the plain loop's data order differs from ours; fix bench/baseline.py.")


def bytecodes_per_step(fn: Any, data: TensorDataset, batch_size: int) -> float:
    """Python bytecodes per optimizer step: (3 epochs - 1 epoch) / the steps in between."""
    global COUNTER
    counts, steps = [], []
    for epochs in (1, 3):
        COUNTER = BytecodeCounter()
        with COUNTER.counting():
            steps.append(fn(data, batch_size, epochs)[1])
        counts.append(COUNTER.count)
    COUNTER = None
    return (counts[1] - counts[0]) / (steps[1] - steps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--count-bytecodes", action="store_true",
                        help="count the Python bytecodes per step instead of timing (deterministic)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = digits_data()
    assert_same_order(data, args.batch_size)
    variants = {"plain": plain_loop, "runtime": runtime_loop, "engine": engine_loop}
    if args.count_bytecodes:
        for fn in variants.values():  # first-call costs (imports, caches) out of the count
            fn(data, args.batch_size, 1)
        counted = {name: bytecodes_per_step(fn, data, args.batch_size) for name, fn in variants.items()}
        print(f"MLP 64-128-64-10, digits, batch {args.batch_size}: Python bytecodes per optimizer step")
        for name, n in counted.items():
            print(f"  {name:8s} {n:8.0f}   +{n - counted['plain']:5.0f} over plain, ratio {n / counted['plain']:.3f}")
        return
    for fn in variants.values():  # warm-up: imports, allocator, first-call costs
        fn(data, args.batch_size, 1)
    # The plain loop once more, last in each round: its ratio to the first is this measurement's
    # noise floor (what a ratio reads when nothing differs), printed beside the others.
    variants["plain again"] = plain_loop
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
        print(f"  {name:11s} {med[name] * 1e6:8.1f} us/step (median)   ratio to plain: "
              f"{med[name] / med['plain']:.3f} of medians, {paired[name]:.3f} median of paired rounds"
              + ("   <- the noise floor: the same loop twice" if name == "plain again" else ""))


if __name__ == "__main__":
    main()
