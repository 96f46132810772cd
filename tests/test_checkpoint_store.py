"""Checkpoint folders: numbering, verification, choice on resume, rotation, crash leftovers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from app.distributed.checkpoint import store
from app.distributed.checkpoint.format import finish, write_safetensors
from app.distributed.checkpoint.store import CheckpointError, Manifest


def make(root, number, step=None, metric=None, mode="max"):
    """A real, committed checkpoint with one data file."""
    temporary = store.temporary_folder(root, number)
    weights = {"w": torch.full((10,), float(number))}
    digest = finish({"m": write_safetensors(temporary / "model.safetensors", weights)})["m"]
    manifest = Manifest(save_number=number, step=step if step is not None else 10 * number,
                        files={"model.safetensors": {"sha256": digest.sha256, "size": digest.size}},
                        metric=None if metric is None else {"name": "eval/accuracy", "value": metric, "mode": mode})
    return store.commit(temporary, root / f"checkpoint_{number}", manifest)


def litter(root):
    """What a crashed or foreign process might leave in checkpoints/."""
    (root / "checkpoint_best").mkdir()                     # not numbered
    (root / "notes.txt").write_text("hello")               # a file
    (root / "checkpoint_9").mkdir()                        # half-written: no manifest
    (root / "checkpoint_9" / "model.safetensors").write_bytes(b"partial")
    (root / "checkpoint_12").mkdir()                       # manifest that is not ours
    (root / "checkpoint_12" / "manifest.json").write_text("{not json")


def one_sentence(message: str) -> bool:
    return message.endswith(".") and "\n" not in message


def test_numbering_continues_past_manifests_and_taken_names(tmp_path):
    root = tmp_path / "checkpoints"
    assert store.next_save_number(root) == 0  # no folder yet
    make(root, 0)
    make(root, 3)
    litter(root)
    # checkpoint_12's name is taken even though its manifest is broken: never reuse it.
    assert store.next_save_number(root) == 13
    assert [m.save_number for _, m in store.complete_checkpoints(root)] == [0, 3]


def test_verify_catches_truncation_tampering_and_missing_files(tmp_path):
    root = tmp_path / "checkpoints"
    folder = make(root, 0)
    assert store.verify(folder) is None
    data = folder / "model.safetensors"
    original = data.read_bytes()
    data.write_bytes(original[:-3])
    assert "truncated" in store.verify(folder)
    data.write_bytes(original[:-1] + b"X")  # same size, different bytes
    assert "SHA-256" in store.verify(folder)
    assert store.quick_check(folder) is None  # sizes only: the run's deep check catches this one
    data.unlink()
    assert "missing" in store.verify(folder)
    (folder / "manifest.json").unlink()
    assert "manifest" in store.verify(folder)


def test_resume_skips_a_corrupt_newest_checkpoint_with_a_warning(tmp_path, caplog):
    root = tmp_path / "run" / "checkpoints"
    make(root, 0)
    good = make(root, 1)
    bad = make(root, 2)
    litter(root)
    (bad / "model.safetensors").write_bytes(b"tampered!" * 3)
    with caplog.at_level(logging.WARNING):
        assert store.find_checkpoint(tmp_path / "run") == good
    assert f"skipping checkpoint {bad}" in caplog.text
    assert store.find_checkpoint(root) == good           # the checkpoints/ folder itself
    assert store.find_checkpoint(root / "checkpoint_0") == root / "checkpoint_0"
    with pytest.raises(CheckpointError, match="checkpoint_2") as err:
        store.find_checkpoint(bad)                       # asked for explicitly: an error, not a fallback
    assert one_sentence(str(err.value))
    assert bad.exists() and (root / "checkpoint_9").exists()  # nothing deleted


@pytest.mark.parametrize("layout", ["missing", "empty", "only_half_written"])
def test_no_checkpoint_is_one_sentence(tmp_path, layout):
    target = tmp_path / "run"
    if layout != "missing":
        (target / "checkpoints").mkdir(parents=True)
    if layout == "only_half_written":
        (target / "checkpoints" / "checkpoint_0").mkdir()
    with pytest.raises(CheckpointError) as err:
        store.find_checkpoint(target)
    assert one_sentence(str(err.value)) and str(target) in str(err.value)


def test_rotation_keeps_newest_and_best_and_ignores_strays(tmp_path):
    root = tmp_path / "checkpoints"
    for n, accuracy in enumerate([0.5, 0.9, 0.7, 0.6, 0.65]):
        make(root, n, metric=accuracy)
    litter(root)
    removed = store.rotate(root, total_limit=2, keep_best=True, newest=root / "checkpoint_4")
    assert sorted(p.name for p in removed) == ["checkpoint_0", "checkpoint_2"]
    names = sorted(p.name for p in root.iterdir())
    assert names == ["checkpoint_1", "checkpoint_12", "checkpoint_3", "checkpoint_4", "checkpoint_9",
                     "checkpoint_best", "notes.txt"]
    # Without keep_best the best goes too, never the newest.
    store.rotate(root, total_limit=1, keep_best=False, newest=root / "checkpoint_4")
    assert [p.name for p, _ in store.complete_checkpoints(root)] == ["checkpoint_4"]
    assert store.rotate(root, total_limit=None, keep_best=False, newest=root / "checkpoint_4") == []


def test_best_checkpoint_respects_min_mode(tmp_path):
    root = tmp_path / "checkpoints"
    for n, loss in enumerate([0.3, 0.1, 0.2]):
        make(root, n, metric=loss, mode="min")
    make(root, 3)  # no evaluation at that step
    assert store.best_checkpoint(store.complete_checkpoints(root)) == root / "checkpoint_1"


def test_commit_replaces_an_existing_folder_and_temporaries_are_cleaned(tmp_path):
    root = tmp_path / "checkpoints"
    make(root, 0)
    replacement = store.temporary_folder(root, 0)
    (replacement / "x").write_text("new")
    store.commit(replacement, root / "checkpoint_0", Manifest(save_number=0))
    assert (root / "checkpoint_0" / "x").read_text() == "new"
    leftover = store.temporary_folder(root, 1)
    store.clean_temporaries(root)
    assert not leftover.exists() and sorted(p.name for p in root.iterdir()) == ["checkpoint_0"]


@pytest.mark.signals
@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["before-manifest", "before-rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoints_intact(tmp_path, point):
    """SIGKILL at a fault-injection point: no checkpoint_1 appears; checkpoint_0 is still chosen."""
    root = tmp_path / "run" / "checkpoints"
    make(root, 0)
    script = textwrap.dedent(f"""
        from pathlib import Path
        from tests.test_checkpoint_store import make
        make(Path({str(root)!r}), 1)
    """)
    env = {**os.environ, store.FAULT_ENV: f"{point}:1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=os.getcwd(), timeout=60, check=False)
    assert proc.returncode == -9
    assert not (root / "checkpoint_1").exists()
    assert any(p.name.startswith(".tmp-checkpoint_1-") for p in root.iterdir())
    assert store.find_checkpoint(tmp_path / "run") == root / "checkpoint_0"
    assert store.next_save_number(root) == 1


@pytest.mark.signals
@pytest.mark.timeout(60)
def test_cleanup_leaves_a_live_writers_temporary_folder_alone(tmp_path):
    root = tmp_path / "checkpoints"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from app.distributed.checkpoint import store
        print(store.temporary_folder(Path({str(root)!r}), 5), flush=True)
        time.sleep(120)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        theirs = Path(writer.stdout.readline().strip())
        assert theirs.is_dir() and f"-{writer.pid}@" in theirs.name
        mine = store.temporary_folder(root, 6)
        (root / ".tmp-checkpoint_rotated-checkpoint_1-0a1b2c3d").mkdir()  # a crashed rotation's leftover
        store.clean_temporaries(root)
        assert [p.name for p in root.iterdir()] == [theirs.name]  # ours and the crash's go, the live one stays
        assert not mine.exists()
    finally:
        writer.kill()
        writer.wait(timeout=30)
    store.clean_temporaries(root)  # its writer is gone now
    assert list(root.iterdir()) == []
