"""``Accelerator.save_state`` / ``load_state`` / ``save_model`` in one process."""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from app.distributed import Accelerator
from app.distributed.checkpoint.store import CheckpointError, read_manifest
from app.distributed.data.map_style import shard_dataloader
from app.distributed.state import GradientState


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self):
        return {"value": self.value, "history": [torch.tensor([self.value])]}

    def load_state_dict(self, state):
        self.value = state["value"]


def build(project_dir, hidden=8, accumulation=2):
    torch.manual_seed(0)
    acc = Accelerator(project_dir=project_dir, seed=1, gradient_accumulation_steps=accumulation)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Dropout(0.5), nn.Linear(hidden, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, *acc.prepare(model, optimizer, loader, scheduler), counter


def train(acc, model, optimizer, scheduler, counter, batches, n):
    losses = []
    for _ in range(n):
        x, y = next(batches)
        with acc.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.value += 1
        losses.append(loss.item())
    return losses


def draws():
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


@pytest.mark.timeout(60)
def test_load_state_continues_exactly_mid_epoch(tmp_path, monkeypatch):
    acc, model, optimizer, loader, scheduler, counter = build(tmp_path)
    loader.set_epoch(1)
    batches = iter(loader)
    train(acc, model, optimizer, scheduler, counter, batches, 4)  # two optimizer steps
    folder = acc.save_state()
    assert folder == tmp_path / "checkpoints" / "checkpoint_0"
    expected = train(acc, model, optimizer, scheduler, counter, batches, 5) + draws()
    expected_weights = {k: v.clone() for k, v in model.state_dict().items()}

    # Loading must not unpickle anything.
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    acc2, model2, optimizer2, loader2, scheduler2, counter2 = build(tmp_path)
    manifest = acc2.load_state()
    assert manifest.save_number == 0 and counter2.value == 4 and loader2.batch_sampler.epoch == 1
    batches2 = iter(loader2)
    assert train(acc2, model2, optimizer2, scheduler2, counter2, batches2, 5) + draws() == expected
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected_weights[key])
    assert acc2.save_state() == tmp_path / "checkpoints" / "checkpoint_1"


def test_checkpoint_files_are_json_or_safetensors(tmp_path):
    acc, model, optimizer, loader, scheduler, counter = build(tmp_path, accumulation=1)
    train(acc, model, optimizer, scheduler, counter, iter(loader), 1)
    folder = acc.save_state()
    manifest = read_manifest(folder)
    names = sorted(manifest.files)
    assert names == ["accelerator_state.json", "custom_checkpoint_0.safetensors", "dataloader.json",
                     "model.safetensors", "optimizer.safetensors", "rng_state_0.safetensors",
                     "scheduler.json"]
    # Each file parses as what its name says (a pickle parses as neither). Checking for pickle's
    # first byte instead was flaky: a safetensors header length of 128 mod 256 starts with 0x80 too.
    from safetensors import safe_open

    for name in names + ["manifest.json"]:
        path = folder / name
        if name.endswith(".json"):
            json.loads(path.read_text(encoding="utf-8"))
        else:
            with safe_open(str(path), framework="pt") as f:
                assert list(f.keys()), f"{name} holds no tensors"


def test_a_checkpoint_for_another_model_is_refused_in_one_sentence(tmp_path):
    acc, *_ = build(tmp_path)
    acc.save_state(metadata={"config_hash": "aaaa"})
    other, *_ = build(tmp_path, hidden=16)
    with pytest.raises(CheckpointError, match=r"\(0.weight has shape \(8, 4\) there, \(16, 4\) here\)") as err:
        other.load_state()
    assert str(err.value).endswith("?") and "\n" not in str(err.value)
    same, *_ = build(tmp_path)
    with pytest.raises(CheckpointError, match="another task or optimizer configuration"):
        same.load_state(config_hash="bbbb")
    same.load_state(config_hash="aaaa")


def test_save_state_to_an_explicit_folder_twice_replaces_it(tmp_path):
    acc, model, *_ = build(tmp_path)
    target = tmp_path / "exp" / "epoch_1"
    acc.save_state(target)
    with torch.no_grad():
        model[0].weight.fill_(3.0)
    acc.save_state(target)
    fresh, model2, *_ = build(tmp_path)
    fresh.load_state(target)
    assert torch.equal(model2[0].weight, torch.full((8, 4), 3.0))
    assert sorted(p.name for p in target.parent.iterdir()) == ["epoch_1"]
    with pytest.raises(ValueError, match="safe_serialization=False"):
        acc.save_state(target, safe_serialization=False)


def test_dataloader_position_is_resharded_by_samples(tmp_path):
    """A position saved by rank 0 of 2 processes (batch 4 each) resumes a 1-process loader
    (batch 8) at the same global sample; an odd position rounds down (samples seen twice)."""
    data = TensorDataset(torch.arange(40).float())

    def shard(processes, rank, batch):
        return shard_dataloader(DataLoader(data, batch_size=batch, shuffle=True), device=torch.device("cpu"),
                                state=GradientState(), num_processes=processes, process_index=rank, seed=5,
                                even_batches=True, split_batches=False)

    two = [shard(2, r, 4) for r in range(2)]
    for loader in two:
        loader.set_epoch(3)
    order = [torch.cat([b[0] for b in batches]) for batches in zip(*two)]  # global steps of 8
    for loader in two:
        loader.set_epoch(3)  # the finished pass moved them on to epoch 4
    consumed = [iter(loader) for loader in two]
    for it in consumed:
        next(it), next(it)
    state = two[0].state_dict()
    assert state == {"epoch": 3, "seed": 5, "global_batch": 8, "samples_in_epoch": 16}
    one = shard(1, 0, 8)
    one.load_state_dict(state)
    rest = [b[0] for b in one]
    assert torch.equal(torch.cat(rest), torch.cat(order[2:]))
    assert len(one) == 5  # len() still counts the whole epoch
    three = shard(1, 0, 12)
    three.load_state_dict(state)
    assert torch.equal(next(iter(three))[0], torch.cat(order)[12:24])


def test_iterating_a_loader_leaves_the_global_rng_alone(tmp_path):
    _, _, _, loader, _, _ = build(tmp_path)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    for _ in loader:
        pass
    assert torch.equal(torch.get_rng_state(), before)


class CountingData(TensorDataset):
    def __init__(self, n: int):
        super().__init__(torch.arange(n).float())
        self.loaded = 0

    def __getitem__(self, i):
        self.loaded += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("position", [1, 12])
def test_resuming_loads_no_skipped_sample(tmp_path, position):
    """Resume cost does not grow with the position in the epoch: only the next batch (and the
    loader's one-batch look-ahead) is loaded."""
    def setup():
        acc = Accelerator(cpu=True, seed=0)
        data = CountingData(104)  # 13 steps of 8
        return acc, acc.prepare(DataLoader(data, batch_size=8, shuffle=True)), data

    acc, loader, data = setup()
    batches = iter(loader)
    for _ in range(position):
        next(batches)
    acc.save_state(tmp_path / "c")
    expected = next(batches)[0]
    acc, loader, data = setup()
    acc.load_state(tmp_path / "c")
    assert torch.equal(next(iter(loader))[0], expected)
    assert data.loaded == 8 * min(2, 13 - position)


def test_a_finished_pass_leaves_nothing_to_skip(tmp_path):
    """A checkpoint taken after a full evaluation pass must not make the next pass empty."""
    acc, _, _, loader, _, _ = build(tmp_path)
    assert len(list(loader)) == 13
    assert loader.state_dict()["samples_in_epoch"] == 0
    acc.save_state(tmp_path / "c")
    again, _, _, loader2, _, _ = build(tmp_path)
    again.load_state(tmp_path / "c")
    assert len(list(loader2)) == 13


def test_each_process_gets_back_its_own_logging_window():
    """The engine's part of a checkpoint holds every process's partial logging window: on as many
    processes each takes its own loss sum, items and task metric sums back; on another number, the
    mean per process (the loss's approximation); a checkpoint from before holds the main process's."""
    from app.engine.checkpoint import TrainerState
    from app.engine.loop import LoopState
    from app.engine.triggers import EarlyStopping

    saved = TrainerState(LoopState(loss_sum=3.0, loss_items=2.0, metric_sums={"m": 1.0}), EarlyStopping("x", "max", None),
                         rank=0, world_size=2)
    saved.loss_sums = [3.0, 5.0]
    saved.windows = [{"loss_items": 2.0, "metric_sums": {"m": 1.0}}, {"loss_items": 4.0, "metric_sums": {"m": 7.0}}]
    state = saved.state_dict()

    def loaded(rank: int, world_size: int, checkpoint: dict) -> LoopState:
        loop = LoopState()
        TrainerState(loop, EarlyStopping("x", "max", None), rank, world_size).load_state_dict(checkpoint)
        return loop

    second = loaded(1, 2, state)
    assert (second.loss_sum, second.loss_items, second.metric_sums) == (5.0, 4.0, {"m": 7.0})
    alone = loaded(0, 1, state)
    assert (alone.loss_sum, alone.metric_sums) == (4.0, {"m": 4.0})
    before = loaded(1, 2, {k: v for k, v in state.items() if k != "windows"})
    assert (before.loss_sum, before.loss_items, before.metric_sums) == (5.0, 2.0, {"m": 1.0})
