"""Checkpoints across processes (gloo, CPU): exact resume at the same world size, and a
2-process checkpoint resumed on 1 process and vice versa (weights and optimizer exact, data
position re-sharded by global samples consumed).

What cannot be exact across a world-size change: the training that follows (gradients are
averaged in another order, and each rank's dropout stream is its own; a rank that did not exist
gets a fresh stream), and a position that is not a whole number of new global batches (rounded
down: a few samples are seen twice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from app.distributed import Accelerator
from tests.conftest import run_app
from tests.helpers.distributed_helpers import ddp_backend, on_processes

pytestmark = [pytest.mark.multiprocess]

N, B, SAVED_AT, MORE = 64, 4, 3, 4
"""Samples, per-process batch on 2 processes, optimizer steps before the save, steps after it."""


def build(acc: Accelerator, batch: int, stateless: bool = False) -> tuple[Any, ...]:
    """The model, optimizer, loader and schedule; ``stateless``: SGD without momentum (no tensor per parameter)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 6, generator=generator), torch.randint(0, 3, (N,), generator=generator),
                         torch.arange(N))
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0) if stateless
                 else torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return acc.prepare(model, optimizer, DataLoader(data, batch_size=batch, shuffle=True), scheduler)


def train(acc: Accelerator, parts: tuple[Any, ...], batches: Any, steps: int) -> tuple[list[float], list[list[int]]]:
    model, optimizer, _, scheduler = parts
    losses, seen = [], []
    for _ in range(steps):
        x, y, idx = next(batches)
        with acc.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        seen.append(idx.tolist())
    return losses, seen


def snapshot(acc: Accelerator, parts: tuple[Any, ...]) -> dict[str, Any]:
    model, optimizer, _, scheduler = parts
    weights = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    moments = {(pid, k): v.clone() for pid, s in optimizer.state_dict()["state"].items() for k, v in s.items()}
    return {"weights": weights, "moments": moments, "lr": scheduler.get_last_lr()}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["weights"].keys() == b["weights"].keys() and a["moments"].keys() == b["moments"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert all(torch.equal(a["moments"][k], b["moments"][k]) for k in a["moments"])
    assert a["lr"] == b["lr"]


# -- workers (module level: the processes are spawned and import them by name) -----------------------


def runtime(kind: str) -> tuple[Accelerator, Any]:
    """A fresh Accelerator for ``kind`` (``ddp`` or ``fsdp``, ``-sgd`` for SGD without momentum) and the matching
    weight snapshot."""
    if kind.startswith("fsdp"):
        from tests.helpers.distributed_helpers import fsdp_backend

        return Accelerator(backend=fsdp_backend(), seed=5, scale_scheduler_by_processes=False), full_snapshot
    return Accelerator(backend=ddp_backend(), seed=5, scale_scheduler_by_processes=False), snapshot


def save_then_continue(folder: str, kind: str = "ddp") -> dict[str, Any]:
    acc, snap = runtime(kind)
    parts = build(acc, B, stateless=kind.endswith("-sgd"))
    batches = iter(parts[2])
    train(acc, parts, batches, SAVED_AT)
    saved = snap(acc, parts)
    acc.save_state(folder)
    losses, seen = train(acc, parts, batches, MORE)
    return {"saved": saved, "losses": losses, "seen": seen, "final": snap(acc, parts)}


def load_then_continue(folder: str, kind: str = "ddp") -> dict[str, Any]:
    acc, snap = runtime(kind)
    parts = build(acc, B, stateless=kind.endswith("-sgd"))
    acc.load_state(folder)
    loaded = snap(acc, parts)
    losses, seen = train(acc, parts, iter(parts[2]), MORE)
    return {"loaded": loaded, "losses": losses, "seen": seen, "final": snap(acc, parts)}


@pytest.fixture(scope="module")
def two_process_checkpoint(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("ws") / "checkpoint"
    return folder, on_processes(save_then_continue, str(folder))


@pytest.mark.timeout(180)
def test_same_world_size_resume_is_exact(two_process_checkpoint):
    folder, uninterrupted = two_process_checkpoint
    resumed = on_processes(load_then_continue, str(folder))
    for rank in range(2):
        assert_same_state(resumed[rank]["loaded"], uninterrupted[rank]["saved"])
        assert resumed[rank]["seen"] == uninterrupted[rank]["seen"]
        assert resumed[rank]["losses"] == uninterrupted[rank]["losses"]  # dropout streams restored per rank
        assert_same_state(resumed[rank]["final"], uninterrupted[rank]["final"])


@pytest.mark.timeout(180)
def test_two_process_checkpoint_resumes_on_one_process(two_process_checkpoint):
    folder, two = two_process_checkpoint
    acc = Accelerator(cpu=True, seed=5, scale_scheduler_by_processes=False)
    parts = build(acc, 2 * B)  # the same global batch
    manifest = acc.load_state(folder)
    assert manifest.world_size == 2
    assert_same_state(snapshot(acc, parts), two[0]["saved"])
    _, seen = train(acc, parts, iter(parts[2]), MORE)
    # Global order: step s of one process = rank 0's then rank 1's batch of step s on two.
    assert seen == [two[0]["seen"][s] + two[1]["seen"][s] for s in range(MORE)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_one_process_checkpoint_resumes_on_two_processes(tmp_path, kind):
    acc = Accelerator(cpu=True, seed=5, scale_scheduler_by_processes=False)
    parts = build(acc, 2 * B)
    batches = iter(parts[2])
    train(acc, parts, batches, SAVED_AT)
    saved = snapshot(acc, parts)
    acc.save_state(tmp_path / "checkpoint")
    _, seen = train(acc, parts, batches, MORE)
    if kind == "ddp":
        two = on_processes(load_then_continue, str(tmp_path / "checkpoint"))
        for rank in range(2):
            assert_same_state(two[rank]["loaded"], saved)
    else:  # full weights broadcast into shards, optimizer state re-keyed by parameter name
        two = on_processes(load_then_continue, str(tmp_path / "checkpoint"), "fsdp")
        assert_same_state(two[0]["loaded"], saved)
    assert [two[0]["seen"][s] + two[1]["seen"][s] for s in range(MORE)] == seen


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_app_on_two_processes_killed_mid_save_resumes_exactly(tmp_path):
    """Rank 0 SIGKILLs itself half-way through its 3rd save; resumed on 2 processes the run ends
    with the uninterrupted run's weights and logged losses (per-rank loss windows included)."""
    from app.distributed.checkpoint.store import FAULT_ENV, complete_checkpoints
    from tests.test_resume import logged

    args = ("hardware=multi_cpu", "hardware.num_processes=2", "trainer.batch_size=16", "trainer.max_epochs=1",
            "checkpoint.every_n_steps=10", "trainer.log_every_n_steps=4", "logging.progress_bar=false",
            "logging.trackers=[]")
    reference, run = tmp_path / "reference", tmp_path / "run"
    run_app(*args, f"hydra.run.dir={reference}", cwd=tmp_path, check=True)
    proc = run_app(*args, f"hydra.run.dir={run}", cwd=tmp_path, env={FAULT_ENV: "files:2"})
    assert proc.returncode != 0
    kept = complete_checkpoints(run / "checkpoints")
    assert [(m.step, m.world_size) for _, m in kept] == [(10, 2), (20, 2)]
    assert {"rng_state_0.safetensors", "rng_state_1.safetensors"} <= set(kept[-1][1].files)
    run_app(f"resume={run}", cwd=tmp_path, check=True)
    assert (run / "model" / "model.safetensors").read_bytes() == (reference / "model" / "model.safetensors").read_bytes()
    assert logged(run) == logged(reference)


# -- FSDP2: sharded weights ------------------------------------------------------------------------


def full_snapshot(acc: Accelerator, parts: tuple[Any, ...]) -> dict[str, Any] | None:
    """Weights and optimizer moments gathered from the shards to rank 0 (keyed by parameter index);
    None on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from app.distributed.checkpoint.layouts import by_parameter_index

    model, optimizer, _, scheduler = parts
    weights = acc.get_state_dict(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if not acc.is_main_process:
        return None
    state = by_parameter_index(state, model, optimizer)
    moments = {(pid, k): v.clone() for pid, s in state["state"].items() for k, v in s.items()}
    return {"weights": weights, "moments": moments, "lr": scheduler.get_last_lr()}


@pytest.mark.timeout(240)
def test_fsdp_checkpoint_is_sharded_and_resumes_exactly_and_on_one_process(tmp_path):
    from app.distributed.checkpoint.store import read_manifest

    folder = tmp_path / "checkpoint"
    uninterrupted = on_processes(save_then_continue, str(folder), "fsdp")
    files = set(read_manifest(folder).files)
    assert {"model/shard-00001-model-00001-of-00001.safetensors",
            "model/shard-00002-model-00001-of-00001.safetensors", "optimizer.safetensors"} <= files
    assert "model.safetensors" not in files
    resumed = on_processes(load_then_continue, str(folder), "fsdp")
    assert_same_state(resumed[0]["loaded"], uninterrupted[0]["saved"])
    for rank in range(2):
        assert resumed[rank]["losses"] == uninterrupted[rank]["losses"]
        assert resumed[rank]["seen"] == uninterrupted[rank]["seen"]
    assert_same_state(resumed[0]["final"], uninterrupted[0]["final"])
    # The same shards on one plain process (another world size and backend).
    acc = Accelerator(cpu=True, seed=5, scale_scheduler_by_processes=False)
    parts = build(acc, 2 * B)
    acc.load_state(folder)
    assert_same_state(snapshot(acc, parts), uninterrupted[0]["saved"])


@pytest.mark.timeout(240)
def test_fsdp_resumes_an_optimizer_without_per_parameter_tensors_exactly(tmp_path):
    """SGD without momentum keeps no tensor per parameter, which torch.distributed.checkpoint cannot place
    ("Expected device to be set"): its groups' settings are loaded, and the run goes on as uninterrupted."""
    folder = str(tmp_path / "checkpoint")
    uninterrupted = on_processes(save_then_continue, folder, "fsdp-sgd")
    resumed = on_processes(load_then_continue, folder, "fsdp-sgd")
    assert_same_state(resumed[0]["loaded"], uninterrupted[0]["saved"])
    assert [r["losses"] for r in resumed] == [r["losses"] for r in uninterrupted]
    assert_same_state(resumed[0]["final"], uninterrupted[0]["final"])
