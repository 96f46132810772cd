"""The hardware registry: every ``hardware=`` option is one spec object, and the rest of the
application reaches a kind only through it (validate, launch, backend, device operations)."""

from __future__ import annotations

import ast
import enum
import re
from pathlib import Path

import pytest
import torch

from app.config import ConfigError, HardwareConfig, HardwareKind, RunConfig
from app.distributed import Backend
from app.distributed.hardware import SPECS, DeviceOps, HardwareSpec, device_ops, hardware_spec, registry
from app.launching.launch import launch
from app.launching.validate import validate
from tests.conftest import REPO, compose_config

# Only these files may name a device type or a collective library in code: the hardware package
# (one file per kind, and the device types' operations) and the torch.distributed backends, whose
# torch APIs differ on CUDA, and the XLA one. Comments and docstrings may mention them; the engine's own test
# (test_engine.py) is stricter and forbids even that.
HARDWARE_FILES = ("app/distributed/hardware/", "app/distributed/backends/torch_distributed.py",
                  "app/distributed/backends/xla_spmd.py", "app/distributed/backends/xla_metrics.py")
DEVICE_NAMES = re.compile(r"\b(cuda|xla|gloo|nccl|mps)\b", re.IGNORECASE)


def code_names(source: str) -> list[tuple[int, str]]:
    """(line, text) of every identifier, attribute and string literal that is not prose (a string
    standing alone as a statement: a docstring, or a field's docstring below it)."""
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.alias):
            out.append((node.lineno, node.name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append((node.lineno, node.value))
    return out


def test_only_the_hardware_files_name_devices_or_collective_libraries():
    offenders = []
    for path in sorted((REPO / "app").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith(HARDWARE_FILES):
            continue
        offenders += [f"{relative}:{line}: {text!r}" for line, text in code_names(path.read_text())
                      if DEVICE_NAMES.search(text)]
    assert offenders == []


def test_the_name_check_sees_code_and_skips_prose():
    source = '"""Runs on CUDA."""\nimport torch\n# nccl here\nx = torch.cuda.is_available()\ny = "gloo"\n'
    assert sorted(text for _, text in code_names(source) if DEVICE_NAMES.search(text)) == ["cuda", "gloo"]


def test_every_hardware_option_has_a_spec_and_every_spec_an_option():
    assert set(SPECS) == {kind.value for kind in HardwareKind}
    for kind in HardwareKind:
        spec = hardware_spec(kind)
        assert spec.kind == kind.value and (REPO / "conf" / "hardware" / f"{kind.value}.yaml").is_file()
    assert registry.multi_process_kinds() == "multi_cpu, multi_gpu or fsdp"


def test_device_operations_follow_the_device_type():
    assert device_ops(torch.device("cpu")).collective_backend == "gloo"
    assert device_ops("cuda").collective_backend.endswith("nccl") and "fp16" in device_ops("cuda").precisions
    assert device_ops("meta") is device_ops("cpu")  # a type no kind declares: the CPU's (no-op) operations
    assert Backend(torch.device("cpu")).rng_state() == {}


class FakeKind(enum.Enum):
    fake = "fake"


class CountingOps(DeviceOps):
    """CPU operations that count the end-of-step hooks and RNG captures the runtime asks for."""

    def __init__(self) -> None:
        self.step_ends = 0
        self.rng_captures = 0

    def step_end(self) -> None:
        self.step_ends += 1

    def rng_state(self) -> dict[str, object]:
        self.rng_captures += 1
        return {}


class FakeSpec(HardwareSpec):
    """A kind that only this test knows: its rule, its process layout and its backend."""

    kind = "fake"

    def __init__(self) -> None:
        self.ops = CountingOps()
        self.backends_built = 0

    def check_devices(self, hw: HardwareConfig, visible: dict[str, int]) -> None:
        if visible.get("fake", 1) == 0:
            raise ConfigError("hardware=fake needs a fake device, but none is visible.")

    def build_backend(self, hw: HardwareConfig) -> Backend:
        self.backends_built += 1
        backend = Backend(torch.device("cpu"))
        backend.ops = self.ops
        return backend


def fake_config(*overrides: str) -> RunConfig:
    cfg = compose_config("logging.trackers=[]", "logging.progress_bar=false", "checkpoint.every_epoch=false",
                         "checkpoint.save_final_model=false", "trainer.eval_every_n_steps=4", *overrides)
    cfg.hardware.kind = FakeKind.fake  # type: ignore[assignment]  # not a HardwareKind: only the registry knows it
    return cfg


def test_a_kind_added_to_the_registry_alone_is_validated_launched_and_built(monkeypatch, tmp_path: Path):
    spec = FakeSpec()
    monkeypatch.setitem(SPECS, "fake", spec)

    with pytest.raises(ConfigError, match="hardware=fake needs a fake device"):
        validate(fake_config(), visible={"fake": 0})
    with pytest.raises(ConfigError, match=r"hardware=fake runs one process; use hardware=multi_cpu, multi_gpu or fsdp"):
        validate(fake_config("hardware.num_processes=2"), visible={})

    launch(fake_config("trainer.max_steps=4", "trainer.gradient_accumulation_steps=2"), tmp_path)
    assert spec.backends_built == 1
    # One end-of-step hook per optimizer step (not per micro-batch), through the Accelerator's optimizer.
    assert spec.ops.step_ends == 4
    assert (tmp_path / "metrics.jsonl").is_file()


def test_rng_files_keep_their_keys_and_a_gpu_checkpoint_restores_on_the_cpu(tmp_path: Path):
    from app.distributed.checkpoint.format import write_state
    from app.distributed.checkpoint.rng import apply_rng, capture_rng
    from app.distributed.checkpoint.store import read_state

    backend = Backend(torch.device("cpu"))
    state = capture_rng(backend)
    assert set(state) == {"python", "numpy", "torch"}
    # What a CUDA machine adds (CudaOps.rng_state): one generator state per device, under "cuda".
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    write_state(tmp_path, "rng_state_0", state)
    expected = torch.rand(3)
    torch.rand(5)  # move the stream on
    apply_rng(read_state(tmp_path, "rng_state_0"), backend)
    assert torch.equal(torch.rand(3), expected)
