"""``task=dpo``: the memory a reference costs, and the training step against TRL's ``DPOTrainer``.

1. **Peak memory by ``task.reference``**: ``python -m app task=dpo`` run in a fresh process per mode
   (``copy``, ``precomputed``, and a reference-free objective, ``task.loss_type=simpo``: no reference
   model and no reference pass), the same Llama (``--hidden``/``--layers``, float32), pairs and steps; the
   figure is the process's peak resident memory (``ru_maxrss``) and its difference from ``copy``, beside
   the model's own size (the copy's cost).
2. **Step time against TRL**: in one process, alternating rounds, the same model, pairs (one batch of
   ``--batch`` pairs, padded the same way) and AdamW: our step (``DPOTask._pairs`` on the concatenated
   batch with the frozen copy, backward, optimizer step) against TRL's (``DPOTrainer.compute_loss`` on its
   collated batch with a ``ref_model``, backward, optimizer step), float32. The ratio is TRL's median step
   time / ours (> 1: ours faster). The whole trainers' overheads (loaders, logging) are not in it.

    python bench/dpo.py [--hidden 256] [--layers 4] [--pairs 64] [--batch 8] [--steps 20] [--rounds 3] [--memory-only]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MEASURE = """
import json, resource, subprocess, sys
subprocess.run([sys.executable, "-m", "app", *json.loads(sys.argv[1])], check=True, capture_output=True)
print("MAXRSS", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""
"""Runs the app in a child of a fresh process: the largest child's peak RSS is the app's."""

def make_data(folder: Path, hidden: int, layers: int, pairs: int) -> None:
    from tests.helpers.dpo_pairs import preference_rows
    from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl

    make_tiny_chat_llama(folder / "base", hidden=hidden, layers=layers, heads=8, kv_heads=4)
    write_jsonl(folder / "prefs.jsonl", preference_rows(pairs))


MODES = {"copy": ("task.reference=copy",), "precomputed": ("task.reference=precomputed",),
         "simpo (reference-free)": ("task.loss_type=simpo",)}
"""The runs whose peak memory is measured, by name: their overrides."""


def peak_memory(folder: Path, mode: str, batch: int, steps: int) -> int:
    args = ["task=dpo", f"task.config={folder / 'base'}", f"task.data_files.train={folder / 'prefs.jsonl'}",
            "task.block_size=128", *MODES[mode], f"trainer.batch_size={batch}",
            f"trainer.max_steps={steps}", "logging.trackers=[]", "logging.progress_bar=false",
            "logging.print_config=false", "checkpoint.save_final_model=false", f"task.cache_dir={folder / 'cache'}",
            f"hydra.run.dir={folder / ('run-' + mode.split()[0])}"]
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(args)], cwd=folder, capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("MAXRSS"))) * 1024


def step_times(folder: Path, batch: int, steps: int, rounds: int) -> tuple[list[float], list[float]]:
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer

    from app.tasks.dpo.config import DPOConfig
    from app.tasks.dpo.reference import FrozenCopy
    from app.tasks.dpo.task import DPOTask
    from tests.helpers.dpo_pairs import preference_rows
    from tests.test_dpo import OneProcess

    torch.set_num_threads(1)
    cfg = DPOConfig(config=str(folder / "base"), cache_dir=str(folder / "cache"), block_size=128, packing=False)
    cfg.data_files.train = str(folder / "prefs.jsonl")
    task = DPOTask(cfg)
    runtime = OneProcess()
    data = task.build_data(runtime)
    torch.manual_seed(0)
    start = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder / "base"))
    ours_model = copy.deepcopy(start).train()
    task.reference = FrozenCopy(start, runtime)
    ours_batch = data.collate_fn([data.train[i] for i in range(batch)])
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-6)

    tokenizer = AutoTokenizer.from_pretrained(folder / "base")
    args = TRLConfig(output_dir=str(folder / "trl"), report_to=[], per_device_train_batch_size=batch, beta=0.1,
                     max_length=128, use_cpu=True, bf16=False)
    trainer = DPOTrainer(model=copy.deepcopy(start), ref_model=copy.deepcopy(start), args=args,
                         train_dataset=datasets.Dataset.from_list(preference_rows(batch)), processing_class=tokenizer)
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(batch)])
    trl_opt = torch.optim.AdamW(trainer.model.parameters(), lr=1e-6)
    trainer.model.train()

    def ours() -> None:
        losses, _ = task._pairs(ours_model, ours_batch)
        losses.mean().backward()
        ours_opt.step()
        ours_opt.zero_grad()

    def theirs() -> None:
        trainer.compute_loss(trainer.model, trl_batch).backward()
        trl_opt.step()
        trl_opt.zero_grad()

    times: dict[str, list[float]] = {"ours": [], "trl": []}
    for r in range(rounds):
        for name, fn in (("ours", ours), ("trl", theirs)) if r % 2 == 0 else (("trl", theirs), ("ours", ours)):
            fn()  # warm
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - t0) / steps)
    return times["ours"], times["trl"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-only", action="store_true", help="only the peak memory (no TRL step times)")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_data(folder, a.hidden, a.layers, a.pairs)
        from transformers import AutoConfig, AutoModelForCausalLM

        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder / "base"))
                     .parameters())
        peaks = {mode: peak_memory(folder, mode, a.batch, a.steps) for mode in MODES}
        ours, trl = ([], []) if a.memory_only else step_times(folder, a.batch, a.steps, a.rounds)
    mib = 2 ** 20
    print(f"model: {params:,} parameters, {4 * params / mib:.1f} MiB in float32")
    for mode, peak in peaks.items():
        print(f"peak RSS {mode}: {peak / mib:.1f} MiB ({(peak - peaks['copy']) / mib:+.1f} MiB vs copy)")
    if ours:
            print(f"step time (s): ours {statistics.median(ours):.4f}, TRL {statistics.median(trl):.4f}; "
              f"TRL / ours = {statistics.median(trl) / statistics.median(ours):.2f}")


if __name__ == "__main__":
    main()
