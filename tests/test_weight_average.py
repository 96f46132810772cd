"""trainer.ema_decay: the moving average of the weights, used for evaluation and the export."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from app.engine.build import build_accelerator, build_components, build_early_stopping
from app.engine.checkpoint import export_model
from app.engine.loop import LoopState, evaluate, fit
from app.engine.weight_average import WeightAverage
from tests.conftest import compose_config


def linear(value: float) -> torch.nn.Linear:
    layer = torch.nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.fill_(value)
        layer.bias.fill_(value)
    return layer


def test_the_average_follows_the_decay_with_its_warm_up():
    layer = linear(0.0)
    average = WeightAverage(layer, decay=0.9)
    expected = 0.0
    for n, value in enumerate([10.0, 20.0, 30.0, 40.0, 50.0]):
        with torch.no_grad():
            layer.weight.fill_(value)
            layer.bias.fill_(value)
        d = min(0.9, (1 + n) / (10 + n))  # 0.1, 0.18, ...: early weights are not pinned to the start
        expected = d * expected + (1 - d) * value
        average.update()
    assert average.average[0] == pytest.approx(torch.full((1, 2), expected))
    assert average.average[1] == pytest.approx(torch.full((1,), expected))
    assert average.updates == 5


def test_applied_swaps_the_average_in_and_the_weights_back():
    layer = linear(1.0)
    average = WeightAverage(layer, decay=0.5)
    with torch.no_grad():
        layer.weight.fill_(3.0)
    average.update()  # weight average: 0.1 * 1 + 0.9 * 3 = 2.8
    with average.applied():
        assert torch.allclose(layer.weight, torch.full((1, 2), 2.8))
    assert torch.equal(layer.weight, torch.full((1, 2), 3.0))
    with pytest.raises(RuntimeError), average.applied():
        raise RuntimeError("evaluation failed")
    assert torch.equal(layer.weight, torch.full((1, 2), 3.0))  # restored on the way out of an error too


def test_state_dict_round_trip_and_mismatch():
    source = WeightAverage(linear(2.0), decay=0.99)
    source.update()
    target = WeightAverage(linear(0.0), decay=0.99)
    target.load_state_dict(source.state_dict())
    assert torch.equal(target.average[0], source.average[0]) and target.updates == 1
    with pytest.raises(ValueError, match="does not match"):
        WeightAverage(torch.nn.Linear(3, 1), decay=0.99).load_state_dict(source.state_dict())
    frozen = torch.nn.Linear(2, 1)
    frozen.bias.requires_grad_(False)
    assert len(WeightAverage(frozen, decay=0.5).average) == 1  # only trainable parameters


def test_training_evaluates_and_exports_the_average(tmp_path):
    cfg = compose_config("logging.trackers=[]", "logging.progress_bar=false", "trainer.batch_size=128",
                         "trainer.max_steps=12", "trainer.ema_decay=0.8", "optim.lr=0.05")
    acc = build_accelerator(cfg, tmp_path)
    acc.init_trackers("test")
    c = build_components(cfg, acc)
    fit(c, cfg, LoopState(), build_early_stopping(cfg))
    assert c.weight_average is not None and c.weight_average.updates == 12
    trained = {n: p.detach().clone() for n, p in c.model.named_parameters()}
    averaged = dict(zip(trained, c.weight_average.average))
    assert all(not torch.allclose(trained[n], averaged[n]) for n in trained)  # two different models

    with_average = evaluate(c)
    c.weight_average = None
    raw = evaluate(c)
    assert with_average["eval/loss"] != raw["eval/loss"]
    assert all(torch.equal(p, trained[n]) for n, p in c.model.named_parameters())  # training weights intact

    logged = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval/loss" in line]
    assert f'"eval/loss": {with_average["eval/loss"]}' in logged[-1]  # the run evaluated the average

    c.weight_average = WeightAverage(c.model, 0.8)
    c.weight_average.load_state_dict({"average": list(averaged.values()), "updates": 12})
    export_model(c, tmp_path / "model")
    exported = load_file(tmp_path / "model" / "model.safetensors")
    assert all(torch.equal(exported[n], averaged[n]) for n in trained)
    acc.end_training()


@pytest.mark.parametrize("overrides, fragment", [
    (["trainer.ema_decay=1.0"], "trainer.ema_decay must be in (0, 1)"),
    (["trainer.ema_decay=0"], "trainer.ema_decay must be in (0, 1)"),
    (["hardware=fsdp", "hardware.num_processes=2", "trainer.ema_decay=0.9"], "does not work with hardware=fsdp"),
])
def test_bad_decay_is_one_sentence(overrides, fragment):
    from app.config import ConfigError
    from app.launching.validate import validate

    with pytest.raises(ConfigError, match=re.escape(fragment)):
        validate(compose_config(*overrides), visible={"cuda": 0})
