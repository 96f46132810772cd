"""GPU check, for a CUDA machine: our runtime and engine against the best plain loop in bf16 and fp16,
and the application on the GPUs present. Run through ``bench/gpu_check.sh`` (about 3-5 minutes on
one GPU); prints one line per figure.

Step time. An MLP (4096-4096-4096-4096-10, batch 256) trained for ``--steps`` steps after warm-up,
wall clock with ``torch.cuda.synchronize`` at both ends, three variants interleaved over
``--rounds`` rounds, medians and median of paired ratios; and each variant's CUDA peak
(``torch.cuda.max_memory_allocated``, reset before each run):
- plain: the best hand-written loop — ``torch.autocast("cuda", dtype)``, for fp16 torch's
  ``GradScaler`` (scale, backward, unscale, clip, step, update), fused AdamW, ``zero_grad(set_to_
  none=True)``, no host sync per step (the loss is read every 10 steps);
- runtime: our ``Accelerator(mixed_precision=...)`` with ``accumulate``/``backward``/``clip_grad_norm_``;
- engine: the application's own ``fit`` loop (evaluation time subtracted).
Held equal: model and initialisation, data and order (``bench/baseline.py``), fused AdamW, clipping at
1.0, no weight decay, constant LR, loss read every 10 steps.

    python bench/gpu_check.py steps [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from baseline import LOG_EVERY, EpochOrder, adamw
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

WIDTH, DEPTH, BATCH, CLASSES, SEED = 4096, 4, 256, 10, 0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))


def make_data(steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    n = BATCH * steps
    return TensorDataset(torch.randn(n, WIDTH, generator=generator), torch.randint(0, CLASSES, (n,), generator=generator))


def plain(data: TensorDataset, precision: str, warmup: int) -> float:
    device = torch.device("cuda")
    model = make_model().to(device)
    opt = adamw(model.parameters(), lr=1e-4, device=device, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    loader = DataLoader(data, batch_sampler=EpochOrder(len(data), BATCH, seed=SEED), pin_memory=True)
    running = torch.zeros((), device=device)
    start = 0.0
    for step, (x, y) in enumerate(loader):
        if step == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=DTYPES[precision]):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        running += loss.detach()
        if (step + 1) % LOG_EVERY == 0:
            running.item()
            running.zero_()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (len(loader) - warmup)


def runtime(data: TensorDataset, precision: str, warmup: int) -> float:
    from app.distributed import Accelerator

    acc = Accelerator(mixed_precision=precision, seed=SEED)
    model = make_model()
    opt = adamw(model.parameters(), lr=1e-4, device=acc.device, weight_decay=0.0)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=BATCH, shuffle=True))
    running = torch.zeros((), device=acc.device)
    start = 0.0
    for step, (x, y) in enumerate(loader):
        if step == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with acc.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        running += loss.detach()
        if (step + 1) % LOG_EVERY == 0:
            running.item()
            running.zero_()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (len(loader) - warmup)


def engine(data: TensorDataset, precision: str, warmup: int) -> float:
    """The application's fit loop; per-step time over the steps after ``warmup`` (timed by the
    loop's own log windows, which exclude evaluation)."""
    from app.config import (
        AdamWConfig,
        EarlyStoppingConfig,
        HardwareConfig,
        HardwareKind,
        LoggingConfig,
        PrecisionConfig,
        PrecisionMode,
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
        def build_data(self, runtime: Any) -> TaskData:
            return TaskData(train=data, eval=TensorDataset(data.tensors[0][:1], data.tensors[1][:1]))

        def build_model(self) -> nn.Module:
            return make_model()

    cfg = RunConfig(task=DigitsConfig(), optim=AdamWConfig(lr=1e-4, weight_decay=0.0, fused=True), seed=SEED,
                    hardware=HardwareConfig(kind=HardwareKind.gpu), precision=PrecisionConfig(mode=PrecisionMode(precision)),
                    scheduler=SchedulerConfig(_target_="app.engine.schedulers.constant_with_warmup"),
                    trainer=TrainerConfig(max_epochs=1, batch_size=BATCH, max_grad_norm=1.0, log_every_n_steps=LOG_EVERY),
                    early_stopping=EarlyStoppingConfig(patience=None),
                    logging=LoggingConfig(trackers=[], progress_bar=False))
    with tempfile.TemporaryDirectory() as tmp:
        acc = build_accelerator(cfg, Path(tmp))
        components = build_components(cfg, acc, BenchTask(cfg.task))
        windows: list[float] = []
        log = acc.log

        def record(values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            if "train/samples_per_s" in values and step is not None and step > warmup:
                windows.append(values["train/samples_per_s"])
            log(values, step=step, **kwargs)

        acc.log = record  # type: ignore[method-assign]
        fit(components, cfg, LoopState(), build_early_stopping(cfg))
        acc.end_training()
    # Equal windows: the mean step time is the batch over the harmonic mean of the rates.
    return BATCH * statistics.mean(1 / w for w in windows)


def steps_check(steps: int, rounds: int) -> None:
    name = torch.cuda.get_device_name(0)
    warmup = 20
    data = make_data(steps + warmup)
    for precision in ("bf16", "fp16"):
        variants = {"plain": plain, "runtime": runtime, "engine": engine}
        for fn in variants.values():
            fn(make_data(2 * warmup), precision, warmup)  # warm-up: kernels, allocator, cuBLAS handles
        times: dict[str, list[float]] = {k: [] for k in variants}
        peaks: dict[str, int] = dict.fromkeys(variants, 0)
        for r in range(rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for key in order:
                gc.collect()  # the previous variant's model and optimizer state gone before measuring
                torch.cuda.reset_peak_memory_stats()
                times[key].append(variants[key](data, precision, warmup))
                peaks[key] = max(peaks[key], torch.cuda.max_memory_allocated())
        med = {k: statistics.median(v) for k, v in times.items()}
        for key in ("runtime", "engine"):
            paired = statistics.median(a / b for a, b in zip(times[key], times["plain"]))
            target = 1.01 if key == "runtime" else 1.02
            print(f"gpu_check {name} {precision}: {key} {med[key] * 1e3:.2f} ms/step vs plain "
                  f"{med['plain'] * 1e3:.2f} ms/step: ratio {med[key] / med['plain']:.3f} "
                  f"(paired {paired:.3f}; target <= {target}); CUDA peak {peaks[key] / 2**20:.0f} MiB vs "
                  f"{peaks['plain'] / 2**20:.0f} MiB: ratio {peaks[key] / peaks['plain']:.3f} (target <= 1.05)")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("check", choices=["steps"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device is visible; run it on a GPU machine.")
    steps_check(args.steps, args.rounds)


if __name__ == "__main__":
    main()
