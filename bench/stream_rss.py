"""Peak memory of a streamed ``task=causal_lm`` run (``task.streaming=true``) against the size of its
training file: the same run (tiny Llama, the same steps, batch and blocks) on a JSON Lines file of
``--small`` MB and one of ``--large`` MB, each ``python -m app`` in its own process, alternating;
the figure is each process's maximum resident set size (``wait4``'s ``ru_maxrss``: the training
process itself on one process), and their ratio. A file read whole would grow with its size; a
stream reads its own part line by line, seeking to its start.

    python bench/stream_rss.py [--small 20] [--large 200] [--steps 30] [--rounds 2] [--processes 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_corpus(path: Path, megabytes: int) -> Path:
    """JSON Lines documents of the toy grammar (tests/helpers/tiny_llama.py) up to ``megabytes``."""
    sys.path.insert(0, str(REPO))
    from tests.helpers.tiny_llama import documents

    chunk = "".join(json.dumps({"text": d}) + "\n" for d in documents(5000, seed=0)).encode()
    with open(path, "wb") as f:
        while f.tell() < megabytes * 1_000_000:
            f.write(chunk)
    return path


def peak_rss_mb(args: list[str], env: dict[str, str]) -> float:
    proc = subprocess.Popen([sys.executable, "-m", "app", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m app failed ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=20)
    parser.add_argument("--large", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.helpers.tiny_llama import make_tiny_llama

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        llama = make_tiny_llama(root / "llama")
        files = {size: write_corpus(root / f"corpus_{size}mb.jsonl", size) for size in (args.small, args.large)}
        hardware = ["hardware=multi_cpu", f"hardware.num_processes={args.processes}"] if args.processes > 1 else []
        peaks: dict[int, list[float]] = {size: [] for size in files}
        for r in range(args.rounds):
            for size in (files if r % 2 == 0 else reversed(list(files))):
                run = root / f"run_{size}_{r}"
                peaks[size].append(peak_rss_mb(
                    ["task=causal_lm", f"task.config={llama}", f"task.data_files.train={files[size]}", "task.streaming=true",
                     "task.block_size=64", "trainer.batch_size=8", f"trainer.max_steps={args.steps}",
                     f"task.cache_dir={root / 'cache'}", "logging.trackers=[]", "logging.progress_bar=false",
                     "checkpoint.save_final_model=false", f"hydra.run.dir={run}", *hardware], env))
                print(f"round {r}: {size} MB file, peak RSS {peaks[size][-1]:.0f} MB", flush=True)
        small, large = statistics.median(peaks[args.small]), statistics.median(peaks[args.large])
        print(json.dumps({"file_mb": [args.small, args.large], "peak_rss_mb": [small, large],
                          "ratio_large_over_small": large / small, "steps": args.steps,
                          "processes": args.processes}, indent=1))


if __name__ == "__main__":
    main()
