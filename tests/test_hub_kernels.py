"""Hub kernels (``USE_HUB_KERNELS``): transformers 5.25+ kernelizes every ``from_pretrained`` model by
default, fetching layers from the Hub and re-kernelizing at each ``model.train()`` — which raises on an
XLA device. The app turns it off unless the user asks, and always on ``hardware=tpu``.

In-process: the choice for each environment; a model the app's loaders build after it is not
kernelized, where transformers alone would kernelize it. ``hardware=tpu`` end to end (a model that
trains on XLA with ``kernels`` installed) is tests/test_xla.py's MRPC run.
"""

from __future__ import annotations

import logging

import pytest
import torch

from app.tasks.hub_kernels import ENV, choose_hub_kernels
from tests.tiny_llama import make_tiny_llama


def test_off_unless_the_user_asks():
    environ: dict[str, str] = {}
    assert choose_hub_kernels(on_xla=False, environ=environ) is False
    assert environ[ENV] == "NO"


@pytest.mark.parametrize("value", ["YES", "yes", "1", "on", "true"])
def test_a_users_yes_is_kept_off_xla(value):
    environ = {ENV: value}
    assert choose_hub_kernels(on_xla=False, environ=environ) is True
    assert environ[ENV] == value


def test_a_users_no_is_kept():
    environ = {ENV: "0"}
    assert choose_hub_kernels(on_xla=False, environ=environ) is False
    assert environ[ENV] == "0"


def test_on_xla_they_stay_off_even_when_asked_and_the_log_says_why(caplog):
    environ = {ENV: "YES"}
    with caplog.at_level(logging.WARNING, logger="app.tasks.hub_kernels"):
        assert choose_hub_kernels(on_xla=True, environ=environ) is False
    assert environ[ENV] == "NO"
    assert [r.getMessage() for r in caplog.records] == [
        ("USE_HUB_KERNELS=YES ignored: Hub kernels do not run on XLA devices (hardware=tpu); the model keeps its "
         "PyTorch layers.")]


def test_quietly_off_on_xla_when_not_asked(caplog):
    environ: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="app.tasks.hub_kernels"):
        assert choose_hub_kernels(on_xla=True, environ=environ) is False
    assert environ[ENV] == "NO" and caplog.records == []


def test_a_model_the_app_loads_after_the_choice_is_not_kernelized(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    from app.tasks.causal_lm.config import CausalLMConfig
    from app.tasks.causal_lm.models import load_model

    if not hasattr(PreTrainedModel, "use_kernels"):
        pytest.skip("this transformers has no Hub kernels")
    folder = make_tiny_llama(tmp_path / "llama", hidden=16, layers=1, heads=2, kv_heads=1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cfg = CausalLMConfig(model=str(folder))

    monkeypatch.setenv(ENV, "")  # recorded, so that the test leaves the variable as it found it
    monkeypatch.delenv(ENV)
    assert load_model(cfg, tokenizer).use_kernels is True  # transformers' own default: the test can fail

    choose_hub_kernels(on_xla=False)
    model = load_model(cfg, tokenizer)
    assert model.use_kernels is False
    model.train()  # what raised on XLA: with kernels off it kernelizes nothing
    assert model.use_kernels is False
