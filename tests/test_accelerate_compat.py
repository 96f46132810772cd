"""What an Accelerate script relies on, beyond Accelerate's own test scripts: Accelerate's data
order, scheduler stepping, ``datasets.Dataset`` splitting, ``kwargs_handlers`` reaching DDP (or
refused), the module-level state objects and utilities. One process here; two processes in one
launch below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, TensorDataset

from app.distributed import Accelerator, AcceleratorState, PartialState
from app.distributed.utils import (
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    LocalSGD,
    find_executable_batch_size,
    set_seed,
)
from tests.helpers.distributed_helpers import ddp_backend, on_processes


def _epochs(loader: Any, n: int = 3) -> list[list[int]]:
    return [[i for (batch,) in loader for i in batch.tolist()] for _ in range(n)]


def test_shuffle_follows_the_plain_loader_and_reshuffles_without_set_epoch():
    data = TensorDataset(torch.arange(24))
    set_seed(11)
    plain = _epochs(DataLoader(data, batch_size=5, shuffle=True))
    set_seed(11)
    prepared = Accelerator(cpu=True).prepare(DataLoader(data, batch_size=5, shuffle=True))
    assert _epochs(prepared) == plain
    assert plain[0] != plain[1] != plain[2]
    # With a data seed (the engine's mode) every epoch reshuffles too, without set_epoch.
    seeded = Accelerator(cpu=True, seed=4).prepare(DataLoader(data, batch_size=5, shuffle=True))
    orders = _epochs(seeded)
    assert orders[0] != orders[1] != orders[2] and sorted(orders[0]) == list(range(24))


def test_custom_batch_samplers_and_iterable_datasets_on_one_process_match_the_plain_loader():
    data = TensorDataset(torch.arange(10))

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(7)

    def loaders() -> list[DataLoader]:
        set_seed(2)
        return [DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 3, drop_last=False)),
                DataLoader(data, sampler=BatchSampler(RandomSampler(data), 3, drop_last=False), batch_size=None),
                DataLoader(Stream(), batch_size=3)]

    expected = []
    for loader in loaders():
        expected.append([torch.as_tensor(b[0] if isinstance(b, list) else b).tolist() for b in loader])
    acc = Accelerator(cpu=True)
    for loader, want in zip(loaders(), expected):
        prepared = acc.prepare(loader)
        got = [torch.as_tensor(b[0] if isinstance(b, list) else b).tolist() for b in prepared]
        assert got == want
    assert expected[2] == [[0, 1, 2], [3, 4, 5], [6]]


def test_state_objects_answer_for_the_live_accelerator():
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    assert acc.state.mixed_precision == AcceleratorState().mixed_precision == "bf16"
    assert PartialState().num_processes == acc.num_processes == 1
    assert PartialState().distributed_type is DistributedType.NO and acc.distributed_type == "NO"
    state = PartialState()
    PartialState._reset_state()
    with pytest.raises(AttributeError, match="This happens if `PartialState._reset_state\\(\\)` was called"):
        _ = state.process_index
    assert PartialState().is_main_process  # creating one again joins the environment again


def test_unsupported_kwargs_handlers_are_refused_with_one_sentence():
    class InitProcessGroupKwargs:  # Accelerate's name; we create the process group ourselves
        pass

    with pytest.raises(ValueError, match="InitProcessGroupKwargs is not supported by app.distributed"):
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs()])
    # One process: there is no DDP wrapper, so DDP arguments have nothing to configure (as in Accelerate).
    Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])


def test_plugin_save_and_state_hooks(tmp_path: Path):
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert acc.gradient_accumulation_steps == 3 and acc.gradient_state.num_steps == 3

    acc.save({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.ones(2))
    acc.save({"step": 3}, tmp_path / "meta.json")
    assert json.loads((tmp_path / "meta.json").read_text()) == {"step": 3}
    with pytest.raises(ValueError, match="never pickle"):
        acc.save({"model": nn.Linear(1, 1)}, tmp_path / "model.bin")

    first, second = acc.prepare(nn.Linear(2, 2)), acc.prepare(nn.Linear(2, 2))
    seen: list[Any] = []
    acc.register_save_state_pre_hook(lambda models, weights, folder: (seen.append(len(weights)), models.pop()))
    acc.register_load_state_pre_hook(lambda models, folder: models.pop())
    folder = acc.save_state(tmp_path / "ckpt")
    assert seen == [2] and not (folder / "model_1.safetensors").exists()
    with torch.no_grad():
        first.weight.fill_(5.0)
        second.weight.fill_(5.0)
    acc.load_state(folder)
    assert not torch.equal(first.weight, torch.full((2, 2), 5.0))  # restored
    assert torch.equal(second.weight, torch.full((2, 2), 5.0))  # left alone by the load hook


def test_project_configuration_total_limit_keeps_the_newest_checkpoints(tmp_path: Path):
    from app.distributed.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(cpu=True, project_config=config)
    model = acc.prepare(nn.Linear(2, 2))
    for value in range(4):
        with torch.no_grad():
            model.weight.fill_(float(value))
        acc.save_state()
    # Accelerate's rotation: the two newest stay (numbered on), the older ones are gone.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_3"]
    acc.load_state()
    assert torch.equal(model.weight, torch.full((2, 2), 3.0))


def test_log_with_all_plugin_options_and_schedule_free_modes(tmp_path: Path):
    assert Accelerator(cpu=True, log_with="all")._log_with == ["tensorboard", "wandb"]  # both installed here

    # sync_with_dataloader=False: the accumulation carries over the end of the (7-batch) epoch.
    plugin = GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=False)
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(7.0)), batch_size=1))
    pattern = []
    for _ in range(2):
        for _batch in loader:
            with acc.accumulate():
                pattern.append(acc.sync_gradients)
    assert [i + 1 for i, synced in enumerate(pattern) if synced] == [3, 6, 9, 12]

    class ScheduleFree(torch.optim.SGD):  # the train()/eval() pair schedule-free optimizers have
        mode = "train"

        def train(self) -> None:
            self.mode = "train"

        def eval(self) -> None:
            self.mode = "eval"

    opt = acc.prepare(ScheduleFree(nn.Linear(1, 1).parameters(), lr=0.1))
    opt.eval()
    assert opt.optimizer.mode == "eval"
    opt.train()
    assert opt.optimizer.mode == "train"


def test_find_executable_batch_size_halves_after_out_of_memory():
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size: int, scale: int) -> int:
        tried.append(batch_size)
        if batch_size > 16:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size * scale

    assert train(2) == 32 and tried == [64, 32, 16]


# -- two processes -------------------------------------------------------------------------------------
class _RankStream(IterableDataset):
    """A different stream on each process: dispatching must hand out rank 0's."""

    def __init__(self, rank: int):
        self.rank = rank

    def __iter__(self):
        yield from (100 * self.rank + i for i in range(7))


def two_process_worker() -> dict[str, Any]:
    import datasets

    backend = ddp_backend()
    rank = backend.process_index
    out: dict[str, Any] = {}

    # Scheduler: Accelerate steps it once per process per optimizer step, unless split_batches; the
    # engine's explicit choice steps it once.
    for name, kwargs in {"default": {}, "split": {"dataloader_config": DataLoaderConfiguration(split_batches=True)},
                         "engine": {"scale_scheduler_by_processes": False}}.items():
        acc = Accelerator(backend=backend, **kwargs)
        model = acc.prepare(nn.Linear(2, 1))
        opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=1.0))
        sched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda step: 0.5 ** step))
        acc.backward(model(torch.ones(4, 2)).sum())
        opt.step()
        sched.step()
        out[f"sched_{name}"] = sched.scheduler.last_epoch

    # kwargs_handlers reach DDP.
    ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=1, static_graph=False,
                                               gradient_as_bucket_view=True, comm_hook=DDPCommunicationHookType.FP16)
    acc = Accelerator(backend=backend, kwargs_handlers=[ddp_kwargs])
    model = acc.prepare(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    acc.backward(model(torch.full((2, 3), float(rank + 1))).sum())
    out["ddp"] = {"find_unused": model.find_unused_parameters, "bucket_bytes": model.bucket_bytes_cap,
                  "static_graph": model.static_graph, "bucket_view": model.gradient_as_bucket_view,
                  "hooks": [hook.__name__ for hook, _ in model._comm_hooks]}
    out["grad"] = model.module[0].weight.grad.tolist()

    # sync_each_batch: gradients are all-reduced on a micro-step that does not step the optimizer.
    for each in (False, True):
        acc = Accelerator(backend=backend, gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=2, sync_each_batch=each))
        model = acc.prepare(nn.Linear(2, 1))
        with acc.accumulate(model):
            acc.backward(model(torch.full((1, 2), float(rank + 1))).sum())
        out[f"first_micro_grad_{each}"] = (acc.sync_gradients, model.module.weight.grad.tolist())

    # A datasets.Dataset is split by rows.
    acc = Accelerator(backend=backend)
    table = datasets.Dataset.from_dict({"k": list(range(5)), "v": [f"r{i}" for i in range(5)]})
    with acc.split_between_processes(table) as rows:
        out["rows"] = {"k": rows["k"], "columns": rows.column_names}

    # Shuffling without set_epoch on two processes: every epoch a new permutation, shared by the ranks.
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
    out["epochs"] = [acc.gather(torch.cat([b for (b,) in loader])).tolist() for _ in range(2)]

    # An iterable dataset is dispatched from the main process by default.
    stream = acc.prepare(DataLoader(_RankStream(rank), batch_size=2))
    out["stream"] = [b.tolist() for b in stream]

    # LocalSGD: each rank steps on its own gradient; every 2 steps the parameters are averaged.
    model = acc.prepare(nn.Linear(2, 1))
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    out["local_sgd"] = []
    with LocalSGD(acc, model, local_sgd_steps=2) as local_sgd:
        for _ in range(2):
            acc.backward(model(torch.full((1, 2), float(rank + 1))).sum())
            opt.step()
            opt.zero_grad()
            local_sgd.step()
            out["local_sgd"].append(acc.unwrap_model(model).weight.detach().flatten().tolist())
    acc.end_training()
    return out


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return on_processes(two_process_worker)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_scheduler_steps_as_accelerate_unless_the_engine_chooses(two: list[dict[str, Any]]):
    for r in two:
        assert (r["sched_default"], r["sched_split"], r["sched_engine"]) == (2, 1, 1)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_ddp_kwargs_reach_the_ddp_wrapper(two: list[dict[str, Any]]):
    for r in two:
        assert r["ddp"] == {"find_unused": True, "bucket_bytes": 1024 * 1024, "static_graph": False,
                            "bucket_view": True, "hooks": ["fp16_compress_hook"]}
    assert two[0]["grad"] == two[1]["grad"]  # the hooked all-reduce still averaged the gradients


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_dataset_split_by_rows_shuffle_and_iterable_dispatch(two: list[dict[str, Any]]):
    r0, r1 = two
    assert r0["rows"] == {"k": [0, 1, 2], "columns": ["k", "v"]} and r1["rows"]["k"] == [3, 4]
    assert r0["epochs"] == r1["epochs"]
    first, second = r0["epochs"]
    assert sorted(first) == sorted(second) == list(range(12)) and first != second
    # Rank 0's stream 0..6 in global batches of 4, the last completed from the first items.
    assert r0["stream"] == [[0, 1], [4, 5]] and r1["stream"] == [[2, 3], [6, 0]]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_local_sgd_steps_locally_then_averages_parameters(two: list[dict[str, Any]]):
    (a1, a2), (b1, b2) = two[0]["local_sgd"], two[1]["local_sgd"]
    # The weights start random, and float32 steps of 0.1 land a few ulps off the exact sums: compared
    # to 1e-6 (rounding both sides to 6 places failed when a value sat at a rounding boundary).
    # After one local step the ranks differ by their gradients (x = 1 and x = 2, lr 0.1) ...
    assert [a - b for a, b in zip(a1, b1)] == pytest.approx([0.1, 0.1], abs=1e-6)
    # ... after the second, both hold the average of their local models: w0 - 0.1 * 2 * (1 + 2) / 2,
    # where rank 0's first step left w0 - 0.1.
    assert a2 == b2
    assert a2 == pytest.approx([x - 0.2 for x in a1], abs=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_sync_each_batch_all_reduces_every_micro_step(two: list[dict[str, Any]]):
    (step0, local0), (_, local1) = two[0]["first_micro_grad_False"], two[1]["first_micro_grad_False"]
    assert not step0 and local0 != local1  # no_sync: each rank keeps its own gradient
    (step0, synced0), (_, synced1) = two[0]["first_micro_grad_True"], two[1]["first_micro_grad_True"]
    assert not step0 and synced0 == synced1  # all-reduced, although the optimizer does not step yet
