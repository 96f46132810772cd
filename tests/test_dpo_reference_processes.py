"""``task=dpo``'s reference on 2 real processes (gloo), DDP and FSDP2, against 1 process:

- ``task.reference=copy`` under FSDP2 is sharded like the policy: every parameter of the frozen copy
  is a DTensor with a ``Shard`` placement, each process holds half of it; its values, and the first
  step's loss, equal the 1-process ones (and ``precomputed``'s) within 1e-6.
- ``task.reference=precomputed``'s pass is split: each process runs its share of the batches (the
  same number of forwards on both: one padded), the table assembled by an all-reduce equals the
  1-process table within 1e-6, and the log says it was split.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed_helpers import ddp_backend, fsdp_backend, on_processes
from tests.helpers.dpo_pairs import preference_rows
from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl

pytestmark = [pytest.mark.multiprocess]

PAIRS, EVAL_PAIRS, BATCH = 26, 8, 4  # 7 + 2 batches of the pass: one process runs one padding forward
FIRST = 6  # the pairs of the batch every process (and the 1-process run) takes its first step on


def config(folder: Path, reference: str) -> Any:
    from app.tasks.dpo.config import DPOConfig, Reference

    cfg = DPOConfig(model=str(folder / "model"), cache_dir=str(folder / "cache"), block_size=128, packing=False,
                    reference=Reference(reference), reference_batch_size=BATCH)
    cfg.data_files.train, cfg.data_files.validation = str(folder / "train.jsonl"), str(folder / "val.jsonl")
    return cfg


def first_step(runtime: Any, folder: Path, reference: str) -> dict[str, Any]:
    """Data, model and reference built as the engine builds them; the reference values and the loss of
    the first step on the first ``FIRST`` pairs."""
    from app.tasks.dpo.reference import logps_forward
    from app.tasks.dpo.task import DPOTask

    task = DPOTask(config(folder, reference))
    data = task.build_data(runtime)
    model = runtime.prepare_model(task.build_model())
    model.train()
    batch = {k: v.to(runtime.device) for k, v in data.collate_fn([data.train[i] for i in range(FIRST)]).items()}
    values = task.reference(model, batch, logps_forward).cpu()
    out = {"values": values, "loss": task.step(model, batch).mean_loss().item()}
    if reference == "copy":
        parameters = list(task.reference.model.parameters())
        out["placements"] = {str(getattr(p, "placements", "plain")) for p in parameters}
        out["local"] = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in parameters)
        out["whole"] = sum(p.numel() for p in parameters)
    else:
        out["table"], out["pairs_computed"] = task.reference.table, task.reference.pairs_computed
    return out


class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def both_modes(backend: Any, folder: Path) -> dict[str, Any]:
    from app.distributed import Accelerator

    runtime = Accelerator(backend=backend)
    said, logger = Said(), logging.getLogger("app.tasks.dpo.reference")
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    try:
        found = {mode: first_step(runtime, folder, mode) for mode in ("copy", "precomputed")}
    finally:
        logger.removeHandler(said)
    return {**found, "said": said.lines}


def worker(folder: str) -> dict[str, Any]:
    """DDP and FSDP2 on one process group (starting processes costs seconds)."""
    ddp = ddp_backend()
    fsdp = fsdp_backend()  # joins the group the DDP backend made
    try:
        return {"ddp": both_modes(ddp, Path(folder)), "fsdp": both_modes(fsdp, Path(folder)),
                "threads": torch.get_num_threads()}
    finally:
        ddp.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("dpo_reference")
    model = make_tiny_chat_llama(folder / "model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).save_pretrained(model)
    write_jsonl(folder / "train.jsonl", preference_rows(PAIRS, seed=11))
    write_jsonl(folder / "val.jsonl", preference_rows(EVAL_PAIRS, seed=12))
    return folder


@pytest.fixture(scope="module")
def one_process(folder, two_processes) -> dict[str, Any]:
    """On the threads each of the 2 processes ran on: a sum over a row's tokens is exact to 1e-6 only when
    both sides add in the same order."""
    from app.distributed import Accelerator

    runtime, threads = Accelerator(), torch.get_num_threads()
    torch.set_num_threads(two_processes[0]["threads"])
    try:
        found = {mode: first_step(runtime, folder, mode) for mode in ("copy", "precomputed")}
        return {**found, "threads": torch.get_num_threads()}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two_processes(folder) -> tuple[dict[str, Any], dict[str, Any]]:
    return tuple(on_processes(worker, str(folder)))  # type: ignore[return-value]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) < 1e-6


@pytest.mark.timeout(300)
def test_both_sides_add_on_the_same_threads(one_process, two_processes):
    assert [rank["threads"] for rank in two_processes] == [one_process["threads"]] * 2


@pytest.mark.timeout(300)
def test_one_process_modes_agree(one_process):
    copy, precomputed = one_process["copy"], one_process["precomputed"]
    assert close(copy["values"], precomputed["values"])
    assert abs(copy["loss"] - precomputed["loss"]) < 1e-6
    assert copy["placements"] == {"plain"} and copy["local"] == copy["whole"]
    assert precomputed["pairs_computed"] == PAIRS + EVAL_PAIRS
    assert precomputed["table"].shape == (PAIRS + EVAL_PAIRS, 2) and bool((precomputed["table"] < 0).all())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_reference_on_two_processes_equals_one_process(kind, one_process, two_processes):
    alone = one_process["copy"]
    for rank in two_processes:
        found = rank[kind]
        for mode in ("copy", "precomputed"):
            assert close(found[mode]["values"], alone["values"]), (mode, found[mode]["values"] - alone["values"])
            assert abs(found[mode]["loss"] - alone["loss"]) < 1e-6
        copy = found["copy"]
        if kind == "fsdp":  # each process holds its half of the frozen copy, sharded like the policy
            assert copy["placements"] == {"(Shard(dim=0),)"}
            assert copy["whole"] == alone["whole"] and abs(copy["local"] - copy["whole"] / 2) <= 0.01 * copy["whole"]
        else:  # DDP: a whole copy on each process, not wrapped (nothing to synchronise)
            assert copy["placements"] == {"plain"} and copy["local"] == copy["whole"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_precomputed_pass_is_split_and_its_table_is_the_one_process_table(kind, one_process, two_processes):
    table = one_process["precomputed"]["table"]
    shares = [rank[kind]["precomputed"]["pairs_computed"] for rank in two_processes]
    assert sum(shares) == PAIRS + EVAL_PAIRS and max(shares) - min(shares) <= BATCH  # about half each
    for rank in two_processes:
        assert close(rank[kind]["precomputed"]["table"], table)
    said = [line for line in two_processes[0][kind]["said"] if line.startswith("reference log-probabilities")]
    assert said == [(f"reference log-probabilities: one pass over {PAIRS} + {EVAL_PAIRS} pairs with the starting "
                     f"weights (task.reference=precomputed), split over 2 processes: {shares[0]}, {shares[1]} pairs")]


@pytest.mark.timeout(300)
def test_under_bf16_the_copy_runs_in_the_policys_autocast(folder, one_process):
    """The copy is prepared as the policy is: under bf16 autocast it computes what the policy (and so the
    precomputed pass) computes, not its fp32 values."""
    from app.distributed import Accelerator

    runtime = Accelerator(mixed_precision="bf16")
    found = {mode: first_step(runtime, folder, mode) for mode in ("copy", "precomputed")}
    assert close(found["copy"]["values"], found["precomputed"]["values"])
    assert abs(found["copy"]["loss"] - found["precomputed"]["loss"]) < 1e-6
    assert not close(found["copy"]["values"], one_process["copy"]["values"])  # bf16 matmuls, not fp32
