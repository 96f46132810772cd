"""Loss scaling: an overflowing fp16 step is skipped, reported, and does not advance the schedule.

The scaler logic is device-independent, so it is exercised here with torch's CPU GradScaler; the
configuration layer still refuses fp16 without CUDA.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from app.distributed import Accelerator
from app.distributed.precision import Fp16Precision


def test_overflowing_step_is_skipped_and_the_scheduler_does_not_step():
    acc = Accelerator(cpu=True)
    acc.precision = Fp16Precision("cpu")  # what build_precision gives on CUDA, on the CPU scaler
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model, opt, sched = acc.prepare(model, opt, sched)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def train_step(poison: bool) -> None:
        loss = F.mse_loss(model(x), y)
        if poison:
            loss = loss * math.inf
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)  # unscales first
        opt.step()
        sched.step()
        opt.zero_grad()

    before = [p.detach().clone() for p in model.parameters()]
    train_step(poison=True)
    assert acc.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert sched.scheduler.last_epoch == 0

    # Clean steps: the scaler may still back off a few times (fp16 overflow of the scaled
    # backward); every skipped step leaves the schedule alone, every real one advances it.
    skipped = real = 0
    while real < 3:
        train_step(poison=False)
        skipped += acc.optimizer_step_was_skipped
        real += not acc.optimizer_step_was_skipped
        assert sched.scheduler.last_epoch == real
        assert skipped < 20
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert acc.precision.state_dict()["scaler"]["scale"] < 2.0**16  # backed off at least once
