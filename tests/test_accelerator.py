"""The Accelerator on one process: prepare, accumulation, precision, collectives as identities."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from app.distributed import Accelerator
from app.distributed.data_loader import DataLoaderShard
from app.distributed.utils import send_to_device
from app.distributed.wrappers import AcceleratedOptimizer, AcceleratedScheduler


def regression_data(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = x @ torch.randn(6, 1, generator=g, dtype=torch.float64) + 0.1
    return TensorDataset(x, y)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def test_prepare_returns_objects_in_the_given_order():
    acc = Accelerator(cpu=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    loader = DataLoader(regression_data(), batch_size=4)
    out = acc.prepare(sched, loader, opt, model)
    assert isinstance(out[0], AcceleratedScheduler)
    assert isinstance(out[1], DataLoaderShard)
    assert isinstance(out[2], AcceleratedOptimizer)
    assert out[3] is model
    assert acc.prepare(make_model(1)).__class__ is nn.Sequential  # a single object comes back alone


@pytest.mark.parametrize("k, b", [(4, 2), (2, 4), (3, 3)])
def test_accumulating_k_micro_batches_equals_one_big_batch(k, b):
    data = regression_data(n=k * b * 5)
    steps = 5

    # Reference: one batch of k*b per optimizer step, plain PyTorch.
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x, y in DataLoader(data, batch_size=k * b):
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()

    acc = Accelerator(cpu=True, gradient_accumulation_steps=k)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=b))
    optimizer_steps = 0
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        optimizer_steps += acc.sync_gradients
    assert optimizer_steps == steps
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p, p_ref, rtol=1e-12, atol=1e-12)


def test_sync_gradients_pattern_and_forced_sync_at_end_of_dataloader():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    model, opt, loader, sched = acc.prepare(model, opt, DataLoader(regression_data(n=28), batch_size=4), sched)
    pattern = []
    for epoch in range(2):
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(F.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
            pattern.append(acc.sync_gradients)
    # 7 batches: steps after 3, 6 and (forced) 7; the count restarts each epoch.
    assert pattern == [False, False, True, False, False, True, True] * 2
    assert sched.scheduler.last_epoch == 6  # one scheduler step per optimizer step


def test_optimizer_only_steps_on_sync():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(regression_data(n=8), batch_size=2))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    with acc.accumulate(model):
        acc.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    assert not acc.sync_gradients
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is not None for p in model.parameters())  # kept for the next micro-step


def test_bf16_autocast_on_cpu_trains_and_returns_fp32():
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = (x[:, 0] > 0).long()
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    assert acc.mixed_precision == "bf16"
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    seen_dtypes = []
    model[0].register_forward_hook(lambda m, i, o: seen_dtypes.append(o.dtype))
    losses = []
    for _ in range(5):
        for xb, yb in loader:
            logits = model(xb)
            assert logits.dtype == torch.float32  # outputs are cast back for the loss
            loss = F.cross_entropy(logits, yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert seen_dtypes[0] == torch.bfloat16  # the matmul really ran in bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert sum(losses[-8:]) / 8 < 0.5 * sum(losses[:8]) / 8
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu")


def test_fp16_on_cpu_is_refused_with_one_sentence():
    with pytest.raises(ValueError, match=r"^precision=fp16 needs a CUDA GPU \(loss scaling on CPU is not supported\); "
                                         r"use bf16 or no\.$"):
        Accelerator(cpu=True, mixed_precision="fp16")


def test_clip_grad_norm_returns_the_norm_before_clipping():
    acc = Accelerator(cpu=True)
    model = acc.prepare(make_model())
    x, y = regression_data(n=8)[:]
    acc.backward(100 * F.mse_loss(model(x), y))
    expected = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    norm = acc.clip_grad_norm_(model.parameters(), max_norm=1.0)
    torch.testing.assert_close(norm, expected)
    clipped = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped == pytest.approx(1.0, rel=1e-4)


def test_single_process_collectives_and_process_helpers():
    acc = Accelerator(cpu=True)
    assert (acc.num_processes, acc.process_index, acc.is_main_process, acc.is_last_process) == (1, 0, True, True)
    t = torch.arange(4.0)
    assert torch.equal(acc.gather(t), t)
    assert torch.equal(acc.gather(torch.tensor(3.0)), torch.tensor([3.0]))
    assert torch.equal(acc.reduce(t, "sum"), t)
    assert acc.gather_object(["a", "b"]) == ["a", "b"]
    assert torch.equal(acc.pad_across_processes(t), t)
    with acc.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    calls = []
    acc.on_main_process(lambda: calls.append("main"))()
    acc.on_process(lambda: calls.append("p1"), process_index=1)()
    assert calls == ["main"]
    with acc.main_process_first():
        calls.append("inside")
    assert calls == ["main", "inside"]
    with pytest.raises(ValueError, match="reduction must be one of"):
        acc.reduce(t, "median")


def test_trigger_is_seen_once_then_reset():
    acc = Accelerator(cpu=True)
    assert not acc.check_trigger()
    acc.set_trigger()
    assert acc.check_trigger()
    assert not acc.check_trigger()


def test_gather_for_metrics_on_one_process_keeps_every_sample():
    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(9)), batch_size=5))
    seen = [acc.gather_for_metrics(batch) for (batch,) in loader]
    assert torch.equal(torch.cat(seen), torch.arange(9))


def test_skip_first_batches_resumes_mid_epoch_without_loading_skipped_samples():
    loaded = []

    class Recording(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            loaded.append(i)
            return torch.tensor(i)

    acc = Accelerator(cpu=True, seed=3)
    loader = acc.prepare(DataLoader(Recording(), batch_size=4, shuffle=True))
    loader.set_epoch(1)
    full = [b.tolist() for b in loader]
    loaded.clear()
    loader.set_epoch(1)
    rest = [b.tolist() for b in acc.skip_first_batches(loader, 3)]
    assert rest == full[3:]
    assert len(loaded) == 8  # only the two remaining batches were read
    loader.set_epoch(1)  # a finished pass moves to the next epoch; come back to epoch 1
    assert [b.tolist() for b in loader] == full  # the skip applied to one pass only


def test_shuffle_differs_per_epoch_and_is_reproducible():
    def epoch_orders(seed):
        acc = Accelerator(cpu=True, seed=seed)
        loader = acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=12, shuffle=True))
        orders = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            orders.append(next(iter(loader))[0].tolist())
        return orders

    a, b = epoch_orders(7), epoch_orders(7)
    assert a == b and a[0] != a[1] and sorted(a[0]) == list(range(12))


def test_send_to_device_moves_every_nested_tensor_and_keeps_containers():
    """The loader moves batches with it on accelerators; here the meta device shows each tensor moved."""
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "x y")
    batch = OrderedDict(ids=torch.ones(2, 3), pair=Pair(torch.zeros(1), [torch.ones(1), "tag"]), n=3)
    moved = send_to_device(batch, torch.device("meta"))
    assert type(moved) is OrderedDict and list(moved) == ["ids", "pair", "n"]
    assert moved["ids"].device.type == "meta" and moved["ids"].shape == (2, 3)
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].x.device.type == "meta" and moved["pair"].y[0].device.type == "meta"
    assert moved["pair"].y[1] == "tag" and moved["n"] == 3
    assert batch["ids"].device.type == "cpu"  # the input is not changed in place
