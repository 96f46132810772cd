"""Step time of one small model on XLA (our SPMD backend, ``hardware=tpu``) against eager CPU (our
one-process CPU backend), and the graphs XLA compiles after warm-up. Run it in the XLA environment:

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 .venv-xla/bin/python bench/xla_step.py [--steps 200] [--warmup 20]

Both sides run the same ``Accelerator`` loop (AdamW, clipping at 1.0, a host read of the loss every
10 steps as the engine logs it) on the same MLP and batches; only the backend differs. Prints the
ratio of median step times (XLA / eager) and the compile counts: during warm-up, and after it (the
figure that must be 0: a graph compiled per step would make XLA useless). On XLA's CPU device the
ratio says what the lazy-tensor machinery costs on a tiny model, not what a TPU gains.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from app.distributed import Accelerator, Backend
from app.distributed.xla_spmd import XlaSpmdBackend

LOG_EVERY = 10


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def batches(n: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g))
            for _ in range(n)]


def compiled_graphs() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def run(backend: Backend, data: list, warmup: int) -> tuple[float, int, int]:
    """Median step time after warm-up, graphs compiled during warm-up, graphs compiled after it."""
    acc = Accelerator(backend=backend, seed=0)
    model = acc.prepare(make_model())
    optimizer = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=backend.fused_optimizers or None))
    is_xla = isinstance(backend, XlaSpmdBackend)
    before = compiled_graphs() if is_xla else 0
    after_warmup = before
    times = []
    running = torch.zeros((), device=acc.device)
    for step, (x, y) in enumerate(data, start=1):
        start = time.perf_counter()
        x, y = backend.place_batch((x, y))
        loss = nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        running += loss.detach()
        if step % LOG_EVERY == 0:
            running.item()  # the engine's log point: the one host read
            running.zero_()
        if step == warmup and is_xla:
            after_warmup = compiled_graphs()
        if step > warmup:
            times.append(time.perf_counter() - start)
    final = compiled_graphs() if is_xla else 0
    return statistics.median(times), after_warmup - before, final - after_warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    data = batches(args.steps, args.batch_size)
    # XLA first: torch's autograd engine sizes its device queues on its first backward, so the XLA
    # device must exist before the eager run's backward.
    xla_backend = XlaSpmdBackend()
    eager, _, _ = run(Backend(torch.device("cpu")), data, args.warmup)
    xla, warm, later = run(xla_backend, data, args.warmup)
    print(f"MLP 64-512-512-10, batch {args.batch_size}, {args.steps} steps ({args.warmup} warm-up), "
          f"XLA devices: {xla_backend.num_devices}")
    print(f"step time XLA / eager CPU: {xla / eager:.2f} ({xla * 1e3:.2f} ms vs {eager * 1e3:.2f} ms, median)")
    print(f"graphs compiled: {warm} during warm-up, {later} in the {args.steps - args.warmup} steps after it")


if __name__ == "__main__":
    main()
