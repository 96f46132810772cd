"""trainer.compile (torch.compile in place: the same parameter names everywhere) and
trainer.deterministic (torch's deterministic algorithms, restored after the run)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from app.config import ConfigError
from app.distributed.determinism import deterministic_algorithms
from app.distributed.hardware import hardware_spec
from app.engine.run import run
from app.launching.validate import validate
from tests.conftest import compose_config

SHORT = ("trainer.max_epochs=-1", "trainer.max_steps=3", "checkpoint.export=last", "logging.trackers=[]",
         "logging.progress_bar=false", "logging.print_config=false")


def test_deterministic_algorithms_are_on_inside_and_restored_after():
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_deterministic_run_repeats_bit_for_bit(tmp_path):
    for name in ("a", "b"):
        run(compose_config(*SHORT, "trainer.deterministic=true"), tmp_path / name)
    assert (tmp_path / "a" / "model" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model" / "model.safetensors").read_bytes()
    assert not torch.are_deterministic_algorithms_enabled()


def test_compile_is_refused_in_one_sentence_where_the_backend_cannot(monkeypatch):
    spec = hardware_spec(compose_config().hardware.kind)
    monkeypatch.setattr(type(spec), "compiles", False)  # a kind whose backend cannot compile
    with pytest.raises(ConfigError, match=r"^trainer.compile=true does not work with hardware=cpu; set "):
        validate(compose_config("trainer.compile=true"), visible={})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_training_keeps_parameter_names_and_learns(tmp_path):
    run(compose_config(*SHORT, "trainer.compile=true", "task.dropout=0"), tmp_path / "compiled")
    run(compose_config(*SHORT, "task.dropout=0"), tmp_path / "eager")
    compiled = load_file(tmp_path / "compiled" / "model" / "model.safetensors")
    eager = load_file(tmp_path / "eager" / "model" / "model.safetensors")
    assert compiled.keys() == eager.keys()  # no _orig_mod. prefix in exports (nor in checkpoints)
    for key in eager:  # without dropout, compiled kernels compute the same steps up to rounding
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5)
