"""The Accelerator API on 2 real processes (gloo): gathers, reductions, padding, splitting,
broadcast, process control, triggers and data sharding.

One launch runs every check (starting processes costs seconds); each rank returns what it saw and
the assertions run here, so a failure shows both ranks' values.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.distributed_helpers import ddp_backend, on_processes

pytestmark = [pytest.mark.multiprocess]


def _accelerator(**kwargs: Any) -> Any:
    from app.distributed import Accelerator

    return Accelerator(backend=kwargs.pop("backend", None) or ddp_backend(), seed=7, **kwargs)


def _loader(n: int, batch_size: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, shuffle=shuffle)


def _epoch(loader: Any) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


def api_worker(tmp: str) -> dict[str, Any]:
    acc = _accelerator()
    rank = acc.process_index
    out: dict[str, Any] = {"rank": rank, "num_processes": acc.num_processes,
                           "distributed_type": acc.distributed_type}

    # gather_for_metrics: 9 samples, batch 5 -> one global step of 10 with one duplicate.
    metrics_loader = acc.prepare(DataLoader(TensorDataset(torch.arange(9)), batch_size=5))
    for (x,) in metrics_loader:
        out["gfm_local"] = x.tolist()
        out["gfm_tensor"] = acc.gather_for_metrics(x).tolist()
        nested = acc.gather_for_metrics({"x": x, "pair": (x * 10, x.float() / 2)})
        out["gfm_nested"] = {"x": nested["x"].tolist(), "pair0": nested["pair"][0].tolist(),
                             "pair1": nested["pair"][1].tolist()}
        out["gfm_objects"] = acc.gather_for_metrics([f"s{i}" for i in x.tolist()], use_gather_object=True)
        out["gfm_scalar"] = acc.gather_for_metrics(torch.tensor(float(rank))).tolist()
        out["gfm_per_rank_object"] = acc.gather_for_metrics({"rank": rank}, use_gather_object=True)
        out["gfm_bool"] = acc.gather_for_metrics(x % 2 == 0).tolist()
    # Several global steps, the last one short: batch 2 -> steps of 4, last step holds sample 8 only.
    small = acc.prepare(DataLoader(TensorDataset(torch.arange(9)), batch_size=2))
    out["gfm_multi_step"] = [v for (x,) in small for v in acc.gather_for_metrics(x).tolist()]
    # Outside a dataloader nothing is trimmed.
    out["gather_outside"] = acc.gather(torch.tensor([rank, rank])).tolist()
    # gather with different dim-0 sizes per rank.
    out["gather_uneven"] = acc.gather(torch.full((rank + 1, 2), rank)).tolist()

    value = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    out["reduce"] = {op: acc.reduce(value, reduction=op).tolist() for op in ("sum", "mean", "max", "min")}
    out["reduce_scaled"] = acc.reduce(value, scale=0.5).tolist()
    out["reduce_int_mean"] = acc.reduce(torch.tensor([rank + 2]), reduction="mean").tolist()
    out["reduce_unchanged_input"] = value.tolist()

    padded = acc.pad_across_processes(torch.ones(2 + 2 * rank, 3) * (rank + 1), dim=0, pad_index=-1)
    out["pad"] = padded.tolist()
    out["pad_first"] = acc.pad_across_processes(torch.ones(1 + rank) * (rank + 1), pad_first=True).tolist()
    out["pad_then_gather"] = acc.gather(padded).shape[0]

    with acc.split_between_processes(list(range(5))) as share:
        out["split_list"] = share
    with acc.split_between_processes(list(range(5)), apply_padding=True) as share:
        out["split_padded"] = share
    with acc.split_between_processes(torch.arange(5), apply_padding=True) as share:
        out["split_tensor"] = share.tolist()
    with acc.split_between_processes({"a": [1, 2, 3, 4], "b": ["w", "x", "y", "z"]}) as share:
        out["split_dict"] = share

    out["broadcast0"] = acc.broadcast(torch.tensor([rank * 5.0])).tolist()
    out["broadcast1"] = acc.broadcast({"t": torch.tensor([rank + 100])}, from_process=1)["t"].tolist()
    out["broadcast_object1"] = acc.broadcast_object({"rank": rank}, from_process=1)

    # main_process_first: the main process finishes its block before any other starts its own.
    log = Path(tmp) / "order.txt"
    with acc.main_process_first():
        with log.open("a") as f:
            f.write(f"{rank} start {time.time()}\n")
        time.sleep(0.3)
        with log.open("a") as f:
            f.write(f"{rank} end {time.time()}\n")
    acc.wait_for_everyone()

    out["on_main"] = acc.on_main_process(lambda: "main")()
    out["on_local_main"] = acc.on_local_main_process(lambda: "local main")()
    out["on_last"] = acc.on_last_process(lambda: "last")()
    out["on_process_1"] = acc.on_process(lambda: "one", process_index=1)()
    out["on_local_process_1"] = acc.on_local_process(local_process_index=1)(lambda: "local one")()

    # Trigger raised on rank 1 only, at step 3: both ranks see it at step 3, then it is reset.
    seen = []
    for step in range(6):
        if rank == 1 and step == 3:
            acc.set_trigger()
        if acc.check_trigger():
            seen.append(step)
    out["trigger_steps"] = seen

    # The loop's per-step stop flag (asynchronous, read one step late): raised on rank 0 only at step 2,
    # every rank learns it at step 3; a flag never raised never reads True.
    flag = acc.step_flag()
    out["flag_steps"] = [step for step in range(6) if flag.post(rank == 0 and step == 2)]
    flag.close()

    out.update(_data_checks(acc, rank))
    acc.end_training()
    return out


def _data_checks(acc: Any, rank: int) -> dict[str, Any]:
    from app.distributed import Accelerator

    out: dict[str, Any] = {}
    # Sharding: one shuffle per epoch (same on every rank), rank r takes batch r of each global step.
    shuffled = acc.prepare(_loader(20, 3, shuffle=True))
    epochs = []
    for epoch in range(2):
        shuffled.set_epoch(epoch)
        epochs.append(_epoch(shuffled))
    out["shard_epochs"] = epochs
    out["shard_len"] = len(shuffled)
    # skip_first_batches: the epoch resumes 2 batches in; the next epoch is whole again.
    shuffled.set_epoch(0)
    out["skip"] = _epoch(acc.skip_first_batches(shuffled, 2))
    shuffled.set_epoch(0)  # a finished pass moves on to epoch 1; come back to epoch 0
    out["after_skip"] = _epoch(shuffled)

    uneven = Accelerator(backend=acc.backend, seed=7, even_batches=False)
    loader = uneven.prepare(_loader(10, 4))
    out["uneven_batches"], out["uneven_len"] = _epoch(loader), len(loader)

    split = Accelerator(backend=acc.backend, seed=7, split_batches=True)
    loader = split.prepare(_loader(10, 4))
    out["split_batches"], out["split_batch_size"] = _epoch(loader), loader.batch_size
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("api")
    ranks = on_processes(api_worker, str(tmp))
    order = [line.split()[:2] for line in (tmp / "order.txt").read_text().splitlines()]
    return {"r0": ranks[0], "r1": ranks[1], "order": order}


@pytest.mark.timeout(120)
def test_topology(results: dict[str, Any]) -> None:
    assert [results["r0"]["rank"], results["r1"]["rank"]] == [0, 1]
    assert results["r0"]["num_processes"] == 2
    assert results["r0"]["distributed_type"] == "MULTI_CPU"


@pytest.mark.timeout(120)
def test_gather_for_metrics_drops_exactly_the_padding(results: dict[str, Any]) -> None:
    r0, r1 = results["r0"], results["r1"]
    assert r0["gfm_local"] == [0, 1, 2, 3, 4] and r1["gfm_local"] == [5, 6, 7, 8, 0]  # 0 is the duplicate
    nine = list(range(9))
    for r in (r0, r1):
        assert r["gfm_tensor"] == nine
        assert r["gfm_nested"] == {"x": nine, "pair0": [10 * i for i in nine], "pair1": [i / 2 for i in nine]}
        assert r["gfm_objects"] == [f"s{i}" for i in nine]
        assert r["gfm_bool"] == [i % 2 == 0 for i in nine]
        assert r["gfm_multi_step"] == nine
        # Per-rank values are not per-sample data: every rank's value is kept.
        assert r["gfm_scalar"] == [0.0, 1.0]
        assert r["gfm_per_rank_object"] == [{"rank": 0}, {"rank": 1}]


@pytest.mark.timeout(120)
def test_gather_and_reduce(results: dict[str, Any]) -> None:
    for r in (results["r0"], results["r1"]):
        assert r["gather_outside"] == [0, 0, 1, 1]
        assert r["gather_uneven"] == [[0, 0], [1, 1], [1, 1]]
        assert r["reduce"] == {"sum": [3.0, 30.0], "mean": [1.5, 15.0], "max": [2.0, 20.0], "min": [1.0, 10.0]}
        assert r["reduce_scaled"] == [1.5, 15.0]
        assert r["reduce_int_mean"] == [2.5]
    assert results["r1"]["reduce_unchanged_input"] == [2.0, 20.0]


@pytest.mark.timeout(120)
def test_pad_across_processes(results: dict[str, Any]) -> None:
    r0, r1 = results["r0"], results["r1"]
    assert r0["pad"] == [[1.0] * 3] * 2 + [[-1.0] * 3] * 2
    assert r1["pad"] == [[2.0] * 3] * 4
    assert r0["pad_first"] == [0.0, 1.0] and r1["pad_first"] == [2.0, 2.0]
    assert r0["pad_then_gather"] == 8


@pytest.mark.timeout(120)
def test_split_between_processes(results: dict[str, Any]) -> None:
    r0, r1 = results["r0"], results["r1"]
    assert (r0["split_list"], r1["split_list"]) == ([0, 1, 2], [3, 4])
    assert (r0["split_padded"], r1["split_padded"]) == ([0, 1, 2], [3, 4, 4])
    assert (r0["split_tensor"], r1["split_tensor"]) == ([0, 1, 2], [3, 4, 4])
    assert r0["split_dict"] == {"a": [1, 2], "b": ["w", "x"]} and r1["split_dict"] == {"a": [3, 4], "b": ["y", "z"]}


@pytest.mark.timeout(120)
def test_broadcast_and_process_control(results: dict[str, Any]) -> None:
    r0, r1 = results["r0"], results["r1"]
    assert r0["broadcast0"] == r1["broadcast0"] == [0.0]
    assert r0["broadcast1"] == r1["broadcast1"] == [101]
    assert r0["broadcast_object1"] == r1["broadcast_object1"] == {"rank": 1}
    assert results["order"] == [["0", "start"], ["0", "end"], ["1", "start"], ["1", "end"]]
    assert (r0["on_main"], r1["on_main"]) == ("main", None)
    assert (r0["on_local_main"], r1["on_local_main"]) == ("local main", None)
    assert (r0["on_last"], r1["on_last"]) == (None, "last")
    assert (r0["on_process_1"], r1["on_process_1"]) == (None, "one")
    assert (r0["on_local_process_1"], r1["on_local_process_1"]) == (None, "local one")


@pytest.mark.timeout(120)
def test_trigger_on_one_rank_stops_both_on_the_same_step(results: dict[str, Any]) -> None:
    assert results["r0"]["trigger_steps"] == results["r1"]["trigger_steps"] == [3]


@pytest.mark.timeout(120)
def test_the_step_flag_is_seen_by_every_rank_at_the_same_later_step(results: dict[str, Any]) -> None:
    assert results["r0"]["flag_steps"] == results["r1"]["flag_steps"] == [3]


def test_sharding_follows_the_global_order(results: dict[str, Any]) -> None:
    r0, r1 = results["r0"], results["r1"]
    assert r0["shard_len"] == r1["shard_len"] == 4  # ceil(20 / (2 * 3)) global steps
    for epoch in range(2):
        generator = torch.Generator().manual_seed(7 + epoch)
        order = torch.randperm(20, generator=generator).tolist()
        padded = order + order[:4]  # even_batches completes the last global step from the start
        interleaved = [i for b0, b1 in zip(r0["shard_epochs"][epoch], r1["shard_epochs"][epoch]) for i in b0 + b1]
        assert interleaved == padded
    assert r0["shard_epochs"][0] != r0["shard_epochs"][1]  # reshuffled each epoch


@pytest.mark.timeout(120)
def test_skip_first_batches_resumes_inside_the_epoch(results: dict[str, Any]) -> None:
    for r in (results["r0"], results["r1"]):
        assert r["skip"] == r["shard_epochs"][0][2:]
        assert r["after_skip"] == r["shard_epochs"][0]


@pytest.mark.timeout(120)
def test_even_batches_false_and_split_batches(results: dict[str, Any]) -> None:
    r0, r1 = results["r0"], results["r1"]
    # 10 samples, batch 4: global steps [0..7] and [8, 9]; rank 1 gets nothing in the second.
    assert (r0["uneven_batches"], r0["uneven_len"]) == ([[0, 1, 2, 3], [8, 9]], 2)
    assert (r1["uneven_batches"], r1["uneven_len"]) == ([[4, 5, 6, 7]], 1)
    # split_batches: the batch size is global; each rank takes its half of every global batch.
    assert r0["split_batch_size"] == 2
    assert r0["split_batches"] == [[0, 1], [4, 5], [8, 9]]
    assert r1["split_batches"] == [[2, 3], [6, 7], [0, 1]]
