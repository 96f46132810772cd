"""A save that runs out of disk ends the run with one sentence (where, how much), exit 1; the
earlier checkpoints stay intact and resumable, and the partial one is removed.

The run writes to a real 1 MiB tmpfs where the test may mount one (root); elsewhere the save's
write fails with ENOSPC through the checkpoint fault-injection point instead."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from app.distributed.checkpoint import store
from tests.conftest import run_app

ARGS = ("trainer.max_steps=12", "checkpoint.every_n_steps=1", "checkpoint.total_limit=null",
        "logging.progress_bar=false", "logging.trackers=[]")


def small_disk(path: Path) -> bool:
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True, check=False)
    return proc.returncode == 0


@pytest.mark.timeout(120)
def test_a_full_disk_during_a_save_is_one_sentence_and_keeps_earlier_checkpoints(tmp_path):
    disk = tmp_path / "disk"
    mounted = small_disk(disk)
    run = disk / "run"
    try:
        env = {} if mounted else {store.FAULT_ENV: "disk-full:3"}
        proc = run_app(*ARGS, f"hydra.run.dir={run}", cwd=tmp_path, env=env, timeout=100)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        match = re.fullmatch(rf"error: no space left on the device of {run / 'checkpoints'} while writing "
                             r"checkpoint_(\d+): it needs (about|more than) [\d.]+ (kB|bytes)(, [\d.]+ \w+ free)?; "
                             r"earlier checkpoints are intact \(free some space, or lower checkpoint.total_limit\)\.",
                             last)
        assert match, last
        root = run / "checkpoints"
        kept = store.complete_checkpoints(root)
        assert [m.save_number for _, m in kept] == list(range(int(match.group(1))))
        assert len(kept) >= 2 and all(store.verify(path) is None for path, _ in kept)
        assert sorted(p.name for p in root.iterdir()) == [p.name for p, _ in kept]  # no partial folder
        assert store.find_checkpoint(run) == kept[-1][0]
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)
