"""Accelerate's own distributed test scripts (from the ``accelerate`` wheel, a test-only dependency)
run on ``app.distributed`` with every ``accelerate`` import resolved to it (tests/helpers/accelerate_runner.py),
on 1 and 2 CPU processes. Every check must pass, except those listed in the runner's EXCLUDED (also
in docs/accelerate.md, with the reason); the counts are what that page reports.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "helpers" / "accelerate_runner.py"

# (script, processes) -> checks run on each process (passed + excluded). A script's own
# conditions decide what runs on CPU (its GPU-only branches are not called).
EXPECTED = {
    ("test_ops", 1): 10, ("test_ops", 2): 10,
    ("test_script", 1): 17, ("test_script", 2): 18,
    ("test_sync", 1): 3, ("test_sync", 2): 4,
    ("test_distributed_data_loop", 2): 14,  # the script asserts two processes
    ("test_notebook", 1): 6, ("test_notebook", 2): 6,  # 1: five skip themselves (need 2 processes)
}
FORKS_ITSELF = {"test_notebook"}
"""Run as one Python process that starts ACCELERATE_NUM_PROCESSES workers with notebook_launcher
(as Accelerate runs it), not under torchrun."""


def run_script(script: str, processes: int, tmp: Path) -> list[dict]:
    out = tmp / f"{script}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ACCELERATE_NUM_PROCESSES": str(processes)}
    launcher = [sys.executable] if processes == 1 or script in FORKS_ITSELF else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    proc = subprocess.run([*launcher, str(RUNNER), script, str(out)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=240, check=False)
    ranks = 1 if script in FORKS_ITSELF else processes
    reports = [json.loads((tmp / f"{script}.json.{rank}").read_text()) for rank in range(ranks)
               if (tmp / f"{script}.json.{rank}").exists()]
    assert len(reports) == ranks, f"{script}: {len(reports)} reports, exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    return reports


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script, processes", sorted(EXPECTED))
def test_accelerate_script_runs_on_app_distributed(script: str, processes: int, tmp_path: Path) -> None:
    for report in run_script(script, processes, tmp_path):
        assert "import_error" not in report and "main_error" not in report, report
        counts = {s: sum(c["status"] == s for c in report["checks"])
                  for s in ("passed", "failed", "excluded", "skipped by the script")}
        failures = [f"{c['label'] or c['check']}:\n{c['error']}" for c in report["checks"] if c["status"] == "failed"]
        assert not failures, "\n".join(failures)
        assert sum(counts.values()) == EXPECTED[(script, processes)], (report["not_called"], counts)
        print(f"{script} on {processes} process(es), rank {report['rank']}: {counts}")


def test_app_never_imports_accelerate() -> None:
    """Real import statements (docstrings may show Accelerate's imports as examples)."""
    offenders = []
    for path in (REPO / "app").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "accelerate"]
    assert offenders == []
