"""What pruning saves a sweep: the same seeded Optuna search run twice in one invocation, with the
median pruner (``hparams_search``'s default) and without (``hydra.sweeper.pruner=none``), each as a
user runs it (``python -m app -m hparams_search=digits_optuna hydra.sweeper.n_trials=12``).

Printed: each trial's state, steps and best value; per search, the trials pruned, the optimizer steps
of all its trials together (read from each job's ``result.json``), its best value and wall time; then
the ratio of the steps (pruned / unpruned) and the difference of the best values.

Targets (issue 25): at least one trial pruned; the pruned search's best value within 0.5 % of the
unpruned one's; fewer steps in all.

    python bench/sweep_pruning.py [--n-trials 12] [--keep <folder>] [-- <more overrides>]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def search(folder: Path, n_trials: int, pruner: str, extra: list[str]) -> dict:
    """Run one search into ``folder``; its trials and totals."""
    command = [sys.executable, "-m", "app", "-m", "hparams_search=digits_optuna", f"hydra.sweeper.n_trials={n_trials}",
               f"hydra.sweeper.pruner={pruner}", f"hydra.sweep.dir={folder}", "logging.progress_bar=false",
               "logging.print_config=false", "logging.trackers=[]", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=folder.parent, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command[1:])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    trials = []
    for number in range(n_trials):
        result = json.loads((folder / str(number) / "result.json").read_text())
        trials.append({"trial": number, "status": result["status"], "steps": int(result["steps"]), "best": result["best"]})
    best = yaml.safe_load((folder / "optimization_results.yaml").read_text())
    return {"pruner": pruner, "trials": trials, "steps": sum(t["steps"] for t in trials),
            "pruned": sum(t["status"] == "pruned" for t in trials), "best_value": float(best["best_value"]),
            "best_trial": int(best["best_trial"]), "wall_s": wall}


def show(result: dict) -> None:
    print(f"pruner={result['pruner']}: " + ", ".join(
        f"{t['trial']}:{t['status']}/{t['steps']}/{t['best']:.4f}" for t in result["trials"]))
    print(f"  {result['pruned']} pruned; {result['steps']} optimizer steps in all; best trial {result['best_trial']} "
          f"= {result['best_value']:.4f}; {result['wall_s']:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-trials", type=int, default=12)
    parser.add_argument("--keep", type=Path, help="run the searches in this folder and keep them")
    parser.add_argument("overrides", nargs="*", help="more overrides for both searches (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sweep-pruning-") as scratch:
        root = args.keep if args.keep is not None else Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        pruned = search(root / "median", args.n_trials, "median", args.overrides)
        show(pruned)
        unpruned = search(root / "none", args.n_trials, "none", args.overrides)
        show(unpruned)
    ratio = pruned["steps"] / unpruned["steps"]
    gap = (pruned["best_value"] - unpruned["best_value"]) / abs(unpruned["best_value"])
    print(f"steps pruned/unpruned: {pruned['steps']}/{unpruned['steps']} = {ratio:.3f}; best value "
          f"{pruned['best_value']:.4f} vs {unpruned['best_value']:.4f} ({gap:+.2%}); wall "
          f"{pruned['wall_s']:.0f} s vs {unpruned['wall_s']:.0f} s")
    ok = pruned["pruned"] >= 1 and abs(gap) <= 0.005 and ratio < 1
    print("targets (>= 1 pruned, best within 0.5 %, fewer steps):", "reached" if ok else "NOT reached")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
