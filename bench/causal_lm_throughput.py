"""``task=causal_lm`` training throughput (tokens/s) through ``python -m app`` against a hand-written
Transformers loop doing the same work, each in its own process, alternating (engine, plain, plain,
engine, ...); the figure is the median over rounds of each round's engine / plain ratio.

Held equal: the model (a Llama of ``--hidden``/``--layers`` randomly initialised from one config
folder, float32, seed 0), the data (the same packed blocks of ``--block-size`` tokens: the plain loop
reads the engine's own tokenization cache, written by a run before the measured ones, so neither
tokenizes in a measured process), batch ``--batch``, the data order (both shuffle the blocks with
``SeedableRandomSampler`` at the run's seed; with packed blocks every batch has the same shape
anyway), torch's fused AdamW at the task's lr 3e-4 and weight decay 0.01 except biases and norm
weights, the linear schedule with 5 % warm-up, clipping at 1.0, the model's own loss, one host read
of the loss every ``--log-every`` steps, and ``--threads`` torch threads per process. Throughput is
tokens/s over the steps after the first ``--log-every`` (warm-up): the engine's own
``train/tokens_per_s`` windows, and the same windows timed in the plain loop.

    python bench/causal_lm_throughput.py [--steps 100] [--rounds 3] [--threads 1] [--hidden 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SEED, LR, WEIGHT_DECAY, WARMUP_RATIO = 42, 3e-4, 0.01, 0.05


def plain_worker(config_dir: str, cache_file: str, steps: int, log_every: int, batch: int) -> dict[str, Any]:
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from app.distributed.data_loader import SeedableRandomSampler
    from app.tasks.causal_lm.batches import LMCollator

    torch.manual_seed(SEED)
    rows = datasets.Dataset.from_file(cache_file)
    sampler = SeedableRandomSampler(rows, data_seed=SEED)
    loader = torch.utils.data.DataLoader(rows, batch_size=batch, sampler=sampler, collate_fn=LMCollator(pad_id=0),
                                         drop_last=False)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, fused=True)
    warm = max(1, int(steps * WARMUP_RATIO))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm)))
    model.train()
    step, epoch, tokens, windows = 0, 0, 0, []
    running = torch.zeros(())
    start = time.perf_counter()
    while step < steps:
        sampler.set_epoch(epoch)
        for b in loader:
            out = model(input_ids=b["input_ids"], labels=b["labels"], use_cache=False)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            running += out.loss.detach()
            tokens += b["labels"].numel()
            step += 1
            if step % log_every == 0:
                running.item()
                running.zero_()
                now = time.perf_counter()
                windows.append(tokens / (now - start))
                start, tokens = now, 0
            if step >= steps:
                break
        epoch += 1
    return {"tokens_per_s": windows}


def engine_args(config_dir: Path, corpus: Path, cache: Path, args: argparse.Namespace, run_dir: Path) -> list[str]:
    return ["task=causal_lm", f"task.config={config_dir}", f"task.data_files.train={corpus}",
            f"task.block_size={args.block_size}", f"task.cache_dir={cache}", f"trainer.batch_size={args.batch}",
            f"trainer.max_steps={args.steps}", f"trainer.log_every_n_steps={args.log_every}", f"seed={SEED}",
            "trainer.eval_batch_size=64", "logging.trackers=[]", "logging.progress_bar=false",
            "checkpoint.every_epoch=false", "checkpoint.save_final_model=false", f"hydra.run.dir={run_dir}"]


def run_engine(config_dir: Path, corpus: Path, cache: Path, args: argparse.Namespace, run_dir: Path,
               env: dict[str, str]) -> list[float]:
    subprocess.run([sys.executable, "-m", "app", *engine_args(config_dir, corpus, cache, args, run_dir)], env=env,
                   check=True, capture_output=True, text=True)
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e["train/tokens_per_s"] for e in events if "train/tokens_per_s" in e]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--plain-worker", nargs=2, metavar=("CONFIG_DIR", "CACHE_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(plain_worker(*args.plain_worker, args.steps, args.log_every, args.batch)))
        return

    sys.path.insert(0, str(REPO))
    from tests.helpers.tiny_llama import documents, make_tiny_llama, write_text

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config_dir = make_tiny_llama(root / "llama", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                                     max_positions=max(256, args.block_size))
        corpus = write_text(root / "corpus.txt", documents(20000, seed=0))
        cache = root / "cache"
        run_engine(config_dir, corpus, cache, argparse.Namespace(**{**vars(args), "steps": 1}), root / "warm", env)
        cache_file = next(cache.glob("lm-train-*.arrow"))
        ratios, engine_all, plain_all = [], [], []
        for r in range(args.rounds):
            order = ("engine", "plain") if r % 2 == 0 else ("plain", "engine")
            figures: dict[str, float] = {}
            for who in order:
                if who == "engine":
                    windows = run_engine(config_dir, corpus, cache, args, root / f"run{r}", env)
                else:
                    out = subprocess.run([sys.executable, __file__, "--plain-worker", str(config_dir), str(cache_file),
                                          f"--steps={args.steps}", f"--log-every={args.log_every}",
                                          f"--batch={args.batch}", f"--threads={args.threads}"],
                                         env=env, check=True, capture_output=True, text=True)
                    windows = json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]
                figures[who] = statistics.mean(windows[1:])  # the first window is warm-up
            ratios.append(figures["engine"] / figures["plain"])
            engine_all.append(figures["engine"])
            plain_all.append(figures["plain"])
            print(f"round {r}: engine {figures['engine']:.0f} tokens/s, plain {figures['plain']:.0f} tokens/s, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        print(json.dumps({"engine_tokens_per_s": statistics.median(engine_all),
                          "plain_tokens_per_s": statistics.median(plain_all),
                          "ratio_median": statistics.median(ratios), "ratios": ratios,
                          "steps": args.steps, "batch": args.batch, "block_size": args.block_size,
                          "threads": args.threads}, indent=1))


if __name__ == "__main__":
    main()
