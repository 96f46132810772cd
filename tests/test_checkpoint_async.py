"""Asynchronous checkpoints (``save_state(async_save=True)``): the call returns before the write, the
checkpoint holds the state *of the call* however training goes on, nothing of it counts (or is
rotated away for it) before it is complete, a failed write is one sentence on the main thread, and a
signal is handled while the main thread waits. On 2 processes (DDP and FSDP2, the shards through
torch.distributed.checkpoint.async_save): every rank's part, the state of the call, and one error
agreed by both ranks. A real SIGKILL during a background write: ``tests/test_resume.py``."""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from app.distributed import Accelerator
from app.distributed.checkpoint import format as checkpoint_format
from app.distributed.checkpoint import store
from app.distributed.checkpoint.errors import CheckpointWriteError
from app.distributed.configuration import ProjectConfiguration
from tests.helpers.distributed_helpers import on_processes
from tests.test_resume_world_size import B, assert_same_state, build, runtime, snapshot, train


def trained(project: Path, total_limit: int | None = None) -> tuple[Accelerator, nn.Module, Any]:
    acc = Accelerator(cpu=True, project_dir=project, project_config=ProjectConfiguration(total_limit=total_limit))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    step(model, optimizer)
    return acc, model, optimizer


def step(model: nn.Module, optimizer: Any) -> None:
    model(torch.randn(16, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


class HeldWrites:
    """Holds the writer thread halfway through a save (at the checkpoint fault point ``files``)
    until :meth:`release`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.reached, self.go = threading.Event(), threading.Event()
        original = store.fault_point

        def fault_point(point: str, save_number: int, path: Path | None = None, step: int | None = None) -> None:
            if point == "files" and threading.current_thread() is not threading.main_thread():
                self.reached.set()
                assert self.go.wait(30)
            original(point, save_number, path, step)

        monkeypatch.setattr(store, "fault_point", fault_point)

    def release(self) -> None:
        self.go.set()


@pytest.mark.timeout(60)
def test_an_async_save_returns_at_once_holds_the_state_of_the_call_and_rotates_only_when_complete(
        tmp_path, monkeypatch):
    acc, model, optimizer = trained(tmp_path, total_limit=1)
    first = acc.save_state()  # synchronous: complete on return
    assert store.verify(first) is None
    held = HeldWrites(monkeypatch)
    at_call = weights(model)
    second = acc.save_state(async_save=True)
    assert held.reached.wait(30)
    # Training goes on while the write is held; the checkpoint being written is no checkpoint yet,
    # and the one before it (total_limit=1) is still there: it is rotated out only after its successor.
    for _ in range(3):
        step(model, optimizer)
    assert not torch.equal(model[0].weight, at_call["0.weight"])
    assert [path for path, _ in store.complete_checkpoints(tmp_path / "checkpoints")] == [first]
    assert store.find_checkpoint(tmp_path) == first
    held.release()
    assert acc.wait_for_checkpoint() == second
    assert acc.wait_for_checkpoint() is None  # nothing in flight any more
    assert [path for path, _ in store.complete_checkpoints(tmp_path / "checkpoints")] == [second]
    assert store.verify(second) is None
    # It holds the weights of the call, not those trained while it was written.
    fresh, fresh_model, _ = trained(tmp_path / "other")
    fresh.load_state(second)
    assert all(torch.equal(v, at_call[k]) for k, v in fresh_model.state_dict().items())


@pytest.mark.timeout(60)
def test_a_failed_background_write_is_one_sentence_on_the_main_thread_and_nothing_is_committed(
        tmp_path, monkeypatch):
    acc, model, optimizer = trained(tmp_path)
    first = acc.save_state(async_save=True)
    acc.wait_for_checkpoint()
    original = checkpoint_format._write

    def failing(path: Path, chunks: list) -> Any:
        if threading.current_thread() is not threading.main_thread() and path.name.startswith("optimizer"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return original(path, chunks)

    monkeypatch.setattr(checkpoint_format, "_write", failing)
    step(model, optimizer)
    acc.save_state(async_save=True)
    with pytest.raises(CheckpointWriteError) as err:
        acc.wait_for_checkpoint()
    message = str(err.value)
    assert message.startswith("could not write checkpoint checkpoint_1 in ") and "Input/output error" in message
    assert message.endswith("the earlier checkpoints are intact.") and "\n" not in message
    assert [path for path, _ in store.complete_checkpoints(tmp_path / "checkpoints")] == [first]
    assert acc.wait_for_checkpoint() is None  # said once
    monkeypatch.setattr(checkpoint_format, "_write", original)
    third = acc.save_state(async_save=True)  # the next save goes on as usual
    assert acc.wait_for_checkpoint() == third and store.verify(third) is None


@pytest.mark.signals
@pytest.mark.timeout(60)
def test_a_signal_during_the_wait_for_a_write_is_handled_at_once(tmp_path, monkeypatch):
    acc, _, _ = trained(tmp_path)
    held = HeldWrites(monkeypatch)
    acc.save_state(async_save=True)
    assert held.reached.wait(30)
    handled: list[bool] = []

    def handler(signum: int, frame: Any) -> None:
        handled.append(held.go.is_set())  # the write is still held when the handler runs

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        # Sent while the main thread waits; the writer thread blocks the signal, so it is handled on
        # the main thread, between two short joins; then the write goes on.
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        threading.Timer(1.5, held.release).start()
        assert acc.wait_for_checkpoint() is not None
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert handled == [False]


# -- two processes -------------------------------------------------------------------------------------


def save_async_then_train(folder: str, kind: str) -> dict[str, Any]:
    """Save asynchronously, train on while the write runs, then wait: returns the state of the call.
    Then a second save whose write fails on rank 1 only: returns the error each rank raised."""
    acc, snap = runtime(kind)
    parts = build(acc, B)
    batches = iter(parts[2])
    train(acc, parts, batches, 3)
    saved = snap(acc, parts)
    acc.save_state(folder, async_save=True)
    train(acc, parts, batches, 4)  # changes weights and moments while they are written
    acc.wait_for_checkpoint()
    if acc.process_index == 1:
        def failing(path: Path, chunks: list) -> Any:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

        checkpoint_format._write = failing  # this worker process only
    acc.save_state(f"{folder}-failed", async_save=True)
    try:
        acc.wait_for_checkpoint()
        error = "no error"
    except CheckpointWriteError as err:
        error = str(err)
    finally:
        acc.end_training()
    return {"saved": saved, "error": error}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_on_two_processes_an_async_save_holds_every_ranks_state_of_the_call_and_fails_alike(tmp_path, kind):
    folder = tmp_path / "checkpoint"
    ranks = on_processes(save_async_then_train, str(folder), kind)
    files = set(store.read_manifest(folder).files)
    assert {"rng_state_0.safetensors", "rng_state_1.safetensors"} <= files  # every rank's part
    if kind == "fsdp":
        assert {"model/shard-00001-model-00001-of-00001.safetensors",
                "model/shard-00002-model-00001-of-00001.safetensors"} <= files
    assert store.verify(folder) is None
    acc = Accelerator(cpu=True, seed=5, scale_scheduler_by_processes=False)
    parts = build(acc, 2 * B)
    acc.load_state(folder)
    assert_same_state(snapshot(acc, parts), ranks[0]["saved"])
    # A write that failed on one rank fails the save on both, in the same sentence; nothing committed.
    errors = [rank["error"] for rank in ranks]
    assert errors[0] == errors[1] and errors[0].startswith("could not write checkpoint checkpoint-failed")
    assert "(process 1: OSError: [Errno 5] Input/output error" in errors[0]
    assert not (tmp_path / "checkpoint-failed").exists()
