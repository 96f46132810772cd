"""A checkpoint is trusted only as far as its manifest: exactly the listed files are read, by the
listed names, each a plain file inside the folder; crafted files are refused in one sentence and a
resume from a run folder falls back to the previous valid checkpoint, saying which it skipped and why.

One real run (6 step checkpoints) is made in-process once; each test tampers with a copy."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from app.distributed.checkpoint import store
from app.distributed.checkpoint.format import sha256_file, write_state
from app.engine.run import run as run_in_process
from tests.conftest import compose_config, run_app

ARGS = ("trainer.max_steps=6", "checkpoint.every_n_steps=1", "checkpoint.total_limit=null",
        "logging.progress_bar=false", "logging.trackers=[]", "checkpoint.save_final_model=false")


@pytest.fixture(scope="module")
def six_checkpoints(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("trust") / "run"
    run_in_process(compose_config(*ARGS), run)
    assert [m.step for _, m in store.complete_checkpoints(run / "checkpoints")] == [1, 2, 3, 4, 5, 6]
    return run


@pytest.fixture
def run(six_checkpoints, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(six_checkpoints, copy)
    return copy


def checkpoint(run: Path, n: int) -> Path:
    return run / "checkpoints" / f"checkpoint_{n}"


def relist(folder: Path, name: str, digest_of: Path | None = None) -> None:
    """Rewrite the manifest so it lists ``name`` with the size and SHA-256 of ``digest_of`` (as an
    attacker who can write the folder would): only the structural checks can refuse it then."""
    manifest = json.loads((folder / "manifest.json").read_text())
    path = digest_of or folder / name
    manifest["files"][name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def replace_listed(folder: Path, name: str, data: bytes) -> None:
    (folder / name).write_bytes(data)
    relist(folder, name)


def header_length_2_60() -> bytes:
    return struct.pack("<Q", 2**60) + b"{}" + bytes(6)


def four_tib_tensor() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(16)


def deep_json() -> bytes:
    return b"[" * 200_000 + b"]" * 200_000


CRAFTED = {
    "header_2_60": ("model.safetensors", header_length_2_60, "header of 1152921504606846976 bytes"),
    "four_tib": ("model.safetensors", four_tib_tensor, "data offsets [0, 4398046511104] outside"),
    "deep_json": ("accelerator_state.json", deep_json, "nested too deeply"),
    "deep_skeleton": ("optimizer.safetensors", None, "skeleton that is nested"),
}


def write_crafted(folder: Path, case: str) -> None:
    name, make, _ = CRAFTED[case]
    if make is not None:
        replace_listed(folder, name, make())
        return
    # A well-formed safetensors file whose JSON skeleton (the optimizer's structure) is 200k deep.
    from app.distributed.checkpoint.format import write_safetensors

    write_safetensors(folder / name, {"t": torch.zeros(1)}, {"skeleton": deep_json().decode()})
    relist(folder, name)


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_files_are_refused_naming_the_file_and_fall_back(run, case, caplog):
    newest = checkpoint(run, 5)
    write_crafted(newest, case)
    name, _, fragment = CRAFTED[case]
    problem = store.verify(newest)
    assert problem is not None and problem.startswith(name) and fragment in problem, problem
    with caplog.at_level(logging.WARNING):
        assert store.find_checkpoint(run) == checkpoint(run, 4)
    assert f"skipping checkpoint {newest}: {name}" in caplog.text
    with pytest.raises(store.CheckpointError) as err:  # named explicitly: refused, no fallback
        store.find_checkpoint(newest)
    assert str(err.value).endswith(".") and "\n" not in str(err.value) and name in str(err.value)


@pytest.mark.parametrize("entry", ["../../outside/secret.txt", "/etc/hostname", "./model.safetensors",
                                   "sub/../model.safetensors", ""])
def test_manifest_entries_outside_the_folder_are_refused_before_opening(run, entry, tmp_path):
    (tmp_path / "outside").mkdir()
    secret = tmp_path / "outside" / "secret.txt"
    secret.write_text("secret")
    newest = checkpoint(run, 5)
    relist(newest, entry, digest_of=secret)
    problem = store.verify(newest)
    assert problem == f"its manifest lists {entry!r}, which is not a plain relative name inside the checkpoint folder"
    assert store.quick_check(newest) == problem
    assert store.find_checkpoint(run, warn=False) == checkpoint(run, 4)


def test_symlinks_are_refused(run, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.copytree(checkpoint(run, 5), outside)
    # A listed file that is a link to an identical file outside: refused although its bytes match.
    weights = checkpoint(run, 5) / "model.safetensors"
    weights.unlink()
    weights.symlink_to(outside / "model.safetensors")
    assert "symlink" in store.verify(checkpoint(run, 5))
    # A newest checkpoint_<N> that links to a complete checkpoint outside is never chosen.
    (run / "checkpoints" / "checkpoint_99").symlink_to(outside)
    assert [p.name for p, _ in store.complete_checkpoints(run / "checkpoints")][-1] == "checkpoint_5"
    assert store.find_checkpoint(run, warn=False) == checkpoint(run, 4)


@pytest.mark.timeout(120)
def test_resume_reads_only_listed_files_and_names_every_skipped_checkpoint(run, tmp_path):
    """One real resume from the run folder passes over five unusable newer checkpoints (each named
    with its reason in a warning), loads checkpoint_0 by its manifest only (an unlisted
    scheduler.safetensors and custom_checkpoint_0.safetensors with a lowered step are ignored and
    named), and goes on from step 1."""
    outside = tmp_path / "elsewhere"
    shutil.copytree(checkpoint(run, 5), outside)
    shutil.rmtree(checkpoint(run, 5))
    checkpoint(run, 5).symlink_to(outside)                                        # a link
    (checkpoint(run, 4) / "manifest.json").unlink()                               # no manifest
    text = (checkpoint(run, 3) / "manifest.json").read_text()
    (checkpoint(run, 3) / "manifest.json").write_text(text[: len(text) // 2])     # half a manifest
    write_crafted(checkpoint(run, 2), "header_2_60")                              # crafted header
    relist(checkpoint(run, 1), "../../outside/secret.txt", digest_of=checkpoint(run, 1) / "dataloader.json")
    first = checkpoint(run, 0)
    state = json.loads((first / "custom_checkpoint_0.json").read_text())
    state["loop"]["global_step"] = -100
    write_state(first, "custom_checkpoint_0", {**state, "x": torch.zeros(1)})      # unlisted, lower step
    write_state(first, "scheduler", {"last_epoch": 1000, "x": torch.zeros(1)})     # unlisted
    assert (first / "custom_checkpoint_0.safetensors").exists() and (first / "scheduler.safetensors").exists()

    proc = run_app(f"resume={run}", "trainer.max_steps=2", *ARGS[1:], cwd=tmp_path, timeout=110)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    for n, reason in [(5, "it is a symlink"), (4, "its manifest.json is missing, truncated or unreadable"),
                      (3, "its manifest.json is missing, truncated or unreadable"),
                      (2, "model.safetensors claims a safetensors header"),
                      (1, "its manifest lists '../../outside/secret.txt', which is not a plain relative name")]:
        assert f"skipping checkpoint {checkpoint(run, n)}: {reason}" in out, (n, out[-3000:])
    assert f"ignoring custom_checkpoint_0.safetensors, scheduler.safetensors in {first}" in out
    assert f"resumed from {first} (step 1," in out
    saved = [m for _, m in store.complete_checkpoints(run / "checkpoints") if m.save_number > 5]
    assert [m.step for m in saved] == [2], saved  # continued from the listed step 1, not -100
    assert os.path.islink(checkpoint(run, 5))  # nothing it refused was touched


def test_a_folder_of_listed_shards_may_hold_nothing_else(run):
    """A sharded state's reader (FSDP2 through torch.distributed.checkpoint) reads its folder whole."""
    folder = checkpoint(run, 5)
    (folder / "model").mkdir()
    (folder / "model.safetensors").rename(folder / "model" / "shard-00001.safetensors")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["model/shard-00001.safetensors"] = manifest["files"].pop("model.safetensors")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert store.verify(folder) is None
    shutil.copy(folder / "model" / "shard-00001.safetensors", folder / "model" / "shard-00002.safetensors")
    assert store.verify(folder) == "model/shard-00002.safetensors is in a folder of listed files but not listed itself"
