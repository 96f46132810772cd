"""Training on 2 real processes gives the weights 1 process gives (DDP and FSDP2), the LR scheduler
steps once per optimizer step when asked to (the engine's explicit choice), and uneven inputs, no_sync and trigger_sync_in_backward behave.

Equivalence: 2 processes with per-process batch b and accumulation k see, per optimizer step, the
same 2*b*k samples that 1 process sees with batch 2*b*k (the sampler's global order), so in float64
the weights must agree to rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.distributed_helpers import ddp_backend, fsdp_backend, on_processes

pytestmark = [pytest.mark.multiprocess]

N, B, K, EPOCHS, SEED = 64, 4, 2, 2, 3
MAX_NORM = 0.5  # small enough that clipping is active on some steps


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(N, 2, generator=generator, dtype=torch.float64)
    return TensorDataset(x, y)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def reference(world: int) -> dict[str, Any]:
    """One process, batch world*B*K, in the documented global order (seed + epoch permutation)."""
    data = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = _scheduler(optimizer)
    batch, norms, lrs = world * B * K, [], []
    for epoch in range(EPOCHS):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        for start in range(0, N, batch):
            x, y = data[order[start:start + batch]]
            F.mse_loss(model(x), y).backward()
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "norms": norms, "lrs": lrs}


def train(kind: str, backend: Any) -> dict[str, Any]:
    from app.distributed import Accelerator

    acc = Accelerator(gradient_accumulation_steps=K, backend=backend, seed=SEED, scale_scheduler_by_processes=False)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = _scheduler(optimizer)
    loader = DataLoader(_data(), batch_size=B, shuffle=True)
    # Everything at once: prepare must re-point the optimizer at FSDP2's sharded parameters.
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    norms, lrs, micro_steps = [], [], 0
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            micro_steps += 1
            with acc.accumulate(model):
                acc.backward(F.mse_loss(model(x), y))
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                if acc.sync_gradients:
                    lrs.append(scheduler.get_last_lr()[0])
    state = acc.get_state_dict(model)
    local = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()} if kind == "ddp" else {}
    out = {"state": state, "local": local, "norms": norms, "lrs": lrs, "micro_steps": micro_steps,
           "scheduler_steps": scheduler.scheduler.last_epoch,
           "reference": reference(acc.num_processes) if acc.is_main_process else None}
    return out


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12, msg=name)


def worker() -> dict[str, Any]:
    """Everything on one process group (starting processes costs seconds)."""
    ddp = ddp_backend()
    fsdp = fsdp_backend()  # joins the process group the DDP backend created
    try:
        return {"ddp": train("ddp", ddp), "fsdp": train("fsdp", fsdp),
                "sync": sync_checks(ddp)}
    finally:
        ddp.shutdown()


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    r0, r1 = on_processes(worker)
    return {key: (r0[key], r1[key]) for key in r0}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_processes_match_one_process_with_the_global_batch(kind: str, results: dict[str, Any]) -> None:
    r0, r1 = results[kind]
    ref = r0["reference"]
    steps = EPOCHS * N // (2 * B * K)
    assert r0["micro_steps"] == r1["micro_steps"] == steps * K
    _assert_same_weights(r0["state"], ref["state"])
    assert r0["norms"] == pytest.approx(ref["norms"], rel=1e-10)
    assert any(n > MAX_NORM for n in ref["norms"])  # clipping really happened
    # The LR scheduler steps once per optimizer step, whatever the number of processes.
    assert r0["scheduler_steps"] == r1["scheduler_steps"] == steps
    assert r0["lrs"] == r1["lrs"] == pytest.approx(ref["lrs"])
    if kind == "ddp":
        _assert_same_weights(r1["local"], r0["local"])  # replicas stay identical
    else:
        assert r1["state"] == {}  # the full state is gathered on rank 0 only


def sync_checks(backend: Any) -> dict[str, Any]:
    """no_sync keeps gradients local; trigger_sync_in_backward averages them although the forward
    ran under no_sync; join_uneven_inputs lets ranks with different batch counts finish."""
    from app.distributed import Accelerator

    acc = Accelerator(backend=backend, seed=SEED)
    rank = acc.process_index
    model = acc.prepare(_model())
    x = torch.full((2, 6), float(rank + 1), dtype=torch.float64)
    out: dict[str, Any] = {}

    def grads() -> torch.Tensor:
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad()
        return flat

    with acc.no_sync(model):
        model(x).sum().backward()
    out["no_sync_equal"] = bool(torch.equal(*acc.gather(grads()[None])))
    with acc.no_sync(model):
        loss = model(x).sum()
        with acc.trigger_sync_in_backward(model):
            loss.backward()
    out["triggered_equal"] = bool(torch.equal(*acc.gather(grads()[None])))

    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    # 64 samples, batch 24: global steps of 48, then 16 left, all for rank 0 without even batches.
    loader = acc.prepare(DataLoader(_data(), batch_size=24))
    with acc.join_uneven_inputs([model], even_batches=False):
        batches = 0
        for bx, by in loader:
            batches += 1
            with acc.accumulate(model):
                acc.backward(F.mse_loss(model(bx), by))
                optimizer.step()
                optimizer.zero_grad()
    out["join_batches"] = batches
    out["even_batches_restored"] = loader.batch_sampler.even_batches
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    out["join_params_equal"] = bool(torch.equal(*acc.gather(params[None])))
    return out


@pytest.mark.timeout(240)
def test_no_sync_trigger_sync_and_join_uneven_inputs(results: dict[str, Any]) -> None:
    r0, r1 = results["sync"]
    assert not r0["no_sync_equal"]
    assert r0["triggered_equal"]
    assert (r0["join_batches"], r1["join_batches"]) == (2, 1)
    assert r0["even_batches_restored"] and r1["even_batches_restored"]
    assert r0["join_params_equal"] and r1["join_params_equal"]


# -- evaluation: metrics computed once, on the main process ------------------------------------------

EVAL_N = 9  # with batch 2 on 2 processes: 3 global steps, the last one holding one real sample


class _RecordingTask:
    """A classifier task whose compute_metrics records how often it ran in this process."""

    name = "recording"

    def __init__(self) -> None:
        self.metric_calls = 0

    def step(self, model: nn.Module, batch: Any) -> Any:
        from app.tasks.base import StepOutput

        x, y = batch
        logits = model(x)
        return StepOutput(loss=F.cross_entropy(logits, y), logits=logits, labels=y)

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        self.metric_calls += 1
        return {"accuracy": float((logits.argmax(-1) == labels).float().mean()), "label_sum": float(labels.sum())}


def _eval_data() -> tuple[TensorDataset, nn.Module]:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(EVAL_N, 4, generator=generator), torch.randint(0, 3, (EVAL_N,), generator=generator))
    torch.manual_seed(0)
    return data, nn.Linear(4, 3)


def evaluation_worker() -> dict[str, Any]:
    from app.distributed import Accelerator
    from app.engine.loop import Components, evaluate

    acc = Accelerator(backend=ddp_backend(), seed=0)
    data, model = _eval_data()
    model = acc.prepare(model)
    loader = acc.prepare(DataLoader(data, batch_size=2))
    task = _RecordingTask()
    metrics = evaluate(Components(acc, task, model, None, None, None, loader))  # type: ignore[arg-type]
    acc.end_training()
    return {"metrics": metrics, "metric_calls": task.metric_calls}


@pytest.mark.timeout(120)
def test_evaluation_metrics_are_computed_on_the_main_process_and_shared() -> None:
    ranks = on_processes(evaluation_worker)
    data, model = _eval_data()
    with torch.no_grad():
        want = _RecordingTask().compute_metrics(model(data.tensors[0]), data.tensors[1])
    # Only the main process held the gathered predictions and computed the metrics ...
    assert [r["metric_calls"] for r in ranks] == [1, 0]
    # ... and every process got the same metrics, over exactly the evaluation set's samples.
    for r in ranks:
        assert r["metrics"]["eval/num_samples"] == EVAL_N
        assert r["metrics"]["eval/accuracy"] == pytest.approx(want["accuracy"])
        assert r["metrics"]["eval/label_sum"] == want["label_sum"]
