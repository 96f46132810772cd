"""Hub kernels (``USE_HUB_KERNELS``): transformers 5.25+ kernelizes every ``from_pretrained`` model by
default, fetching layers from the Hub and kernelizing again at each ``model.train()`` — which raises on
an XLA device. The app turns it off unless the user asks, and always on ``hardware=tpu``.

In-process: the default for each environment, the kinds whose devices refuse Hub kernels, and a model
the app's loader builds after the default is not kernelized where transformers alone would kernelize
it. ``hardware=tpu`` end to end (asked for, kept off, and the model trains on XLA with ``kernels``
installed) is tests/test_xla.py's MRPC run.
"""

from __future__ import annotations

import logging

import pytest
import torch

from app.distributed.hardware import SPECS
from app.launching.hub_kernels import ENV, hub_kernels_off_by_default, keep_hub_kernels_off
from tests.helpers.tiny_llama import make_tiny_llama


def test_off_unless_the_user_set_it():
    environ: dict[str, str] = {}
    hub_kernels_off_by_default(environ)
    assert environ == {ENV: "NO"}


@pytest.mark.parametrize("value", ["YES", "yes", "1", "on", "true", "0", "no"])
def test_the_users_own_setting_is_kept(value):
    environ = {ENV: value}
    hub_kernels_off_by_default(environ)
    assert environ == {ENV: value}


def test_only_the_xla_kind_refuses_them():
    assert {kind: spec.runs_hub_kernels for kind, spec in SPECS.items()} == {
        "tpu": False, "multi_cpu": True, "multi_gpu": True, "fsdp": True, "gpu": True, "cpu": True}


def test_where_refused_they_stay_off_even_when_asked_and_the_log_says_why(caplog):
    environ = {ENV: "YES"}
    with caplog.at_level(logging.WARNING, logger="app.launching.hub_kernels"):
        keep_hub_kernels_off("tpu", environ)
    assert environ == {ENV: "NO"}
    assert [r.getMessage() for r in caplog.records] == [
        ("USE_HUB_KERNELS=YES ignored: Hub kernels do not run on hardware=tpu's devices; the model keeps its "
         "PyTorch layers.")]


def test_where_refused_and_not_asked_nothing_is_said(caplog):
    environ: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="app.launching.hub_kernels"):
        keep_hub_kernels_off("tpu", environ)
    assert environ == {ENV: "NO"} and caplog.records == []


def test_a_model_the_app_loads_after_the_default_is_not_kernelized(tmp_path, monkeypatch):
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

    hub_kernels_off_by_default()
    model = load_model(cfg, tokenizer)
    assert model.use_kernels is False
    model.train()  # what raised on XLA: with kernels off it kernelizes nothing
    assert model.use_kernels is False
