"""trainer.compile: training-step time of the compiled model against eager, after warm-up, in one
invocation (interleaved rounds of the same loop; medians of per-step CPU time).

The model and loop are the engine's digits job (MLP 64-128-64-10, batch 32, AdamW, one thread);
``nn.Module.compile()`` as ``trainer.compile=true`` does. The first compiled steps (graph capture
and code generation) are excluded and reported apart.

    python bench/compile_step.py [--rounds 5] [--steps 200] [--hidden 128,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F


def mlp(hidden: list[int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = 64
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, 10))


def step_times(model: nn.Module, steps: int, batch: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(steps):
        start = time.process_time()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.process_time() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", default="128,64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hidden = [int(h) for h in args.hidden.split(",")]
    eager, compiled = mlp(hidden), mlp(hidden)
    compiled.compile()
    start = time.perf_counter()
    step_times(compiled, 3, args.batch_size)  # warm-up: capture and compile
    warmup = time.perf_counter() - start
    step_times(eager, 3, args.batch_size)
    per_round: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, model in (("eager", eager), ("compiled", compiled)):
            per_round[name].append(statistics.median(step_times(model, args.steps, args.batch_size)))
    e, c = statistics.median(per_round["eager"]), statistics.median(per_round["compiled"])
    print(f"MLP 64-{args.hidden}-10, batch {args.batch_size}, 1 thread, {args.rounds} rounds x {args.steps} steps")
    print(f"eager     {e * 1e3:8.3f} ms/step")
    print(f"compiled  {c * 1e3:8.3f} ms/step   ratio {c / e:.2f}x   (first 3 compiled steps, compile included: {warmup:.2f} s)")


if __name__ == "__main__":
    main()
