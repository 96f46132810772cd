"""AdamW step time on CPU: torch's default per-parameter loop vs ``foreach`` vs the fused kernel.

The parameters are those of a BERT shaped like all-MiniLM-L6-v2 (6 layers, hidden 384, 30,522-token
vocabulary: 22.7 M parameters, the MRPC recipe's model), randomly initialised, with random gradients.
The engine builds AdamW with ``fused=True`` wherever the backend has the kernel (``optim.fused=null``).

    python bench/optimizer_step.py [--threads N] [--rounds R]

Prints the median step time of each variant over R interleaved rounds and its ratio to the default.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import BertConfig, BertModel

VARIANTS = {"default (loop)": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536)
    optimizers = {}
    for name, options in VARIANTS.items():
        params = [p for p in BertModel(config).parameters()]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizers[name] = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **options)
        optimizers[name].step()  # state allocated before timing
    n_params = sum(p.numel() for p in params)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):  # interleaved: machine noise hits every variant alike
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["default (loop)"])
    print(f"AdamW step, {n_params / 1e6:.1f} M parameters, {args.threads} thread(s), median of {args.rounds}:")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:15s} {median * 1000:7.1f} ms   {median / base:5.2f}x the default")


if __name__ == "__main__":
    main()
