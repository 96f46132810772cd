"""Throughput in the training log (``app/engine/throughput.py``): the peak table by device name, the
FLOPs of a transformer as torchtitan counts them (embeddings excluded, attention by sequence length),
tokens counted as the batches are drawn (an int or a device tensor from the task), MFU against a
peak, and the run's means. In this process, on a module shaped as a Transformers model is; the keys
in a real MRPC run's ``metrics.jsonl`` (a real BERT) are checked in ``tests/test_glue_mrpc_app.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from app.config import ConfigError, HardwareConfig
from app.distributed import Accelerator
from app.distributed.hardware.peak_flops import compute_type, peak_flops
from app.engine.throughput import (
    MFU,
    SAMPLES_PER_S,
    TOKENS_PER_S,
    Throughput,
    dense_parameters,
    transformer_shape,
)

T = 1e12


@pytest.mark.parametrize(("name", "kind", "expected"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4 * T),
    ("NVIDIA H100 PCIe", "bf16", 756 * T),
    ("NVIDIA H100 NVL", "fp32", 60 * T),
    ("NVIDIA H200", "tf32", 494.7 * T),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5 * T),
    ("NVIDIA L40S", "bf16", 362 * T),
    ("NVIDIA L4", "bf16", 121 * T),
    ("NVIDIA A10", "bf16", 125 * T),
    ("NVIDIA A10G", "bf16", None),       # another chip than the A10: not guessed
    ("Tesla T4", "bf16", None),          # no bf16 tensor cores
    ("Tesla V100-SXM2-16GB", "fp16", 125 * T),
    ("TPU v5 lite", "fp32", 197 * T),    # a TPU's matrix unit runs bf16 whatever the type
    ("TPU v4", "bf16", 275 * T),
    ("cpu", "fp32", None),
    (None, "bf16", None),
])
def test_peak_flops_by_device_name(name, kind, expected):
    assert peak_flops(name, kind) == expected


def test_the_compute_type_follows_autocast_then_torch_matmul_precision():
    assert compute_type("bf16") == "bf16" and compute_type("fp16", "high") == "fp16"
    assert compute_type("no", "highest") == "fp32" and compute_type("no", "high") == "tf32"


def test_a_peak_override_must_be_positive():
    with pytest.raises(ConfigError, match="hardware.peak_tflops must be positive"):
        HardwareConfig(peak_tflops=0.0).check()


class TinyTransformer(nn.Module):
    """What the FLOPs estimate reads of a Transformers model: a ``config`` with layers, heads and width,
    embedding tables (lookups, no FLOPs) and the dense layers; without importing transformers."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=32)
        self.word_embeddings, self.position_embeddings = nn.Embedding(120, 32), nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
        self.classifier = nn.Linear(32, 2)


def tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TinyTransformer())  # found inside a task's wrapper too


class CountingTask:
    """Counts a batch's non-padding tokens, as an int or (like the text task) as a device tensor."""

    def __init__(self, as_tensor: bool):
        self.as_tensor = as_tensor

    def tokens_in_batch(self, batch: Any) -> int | torch.Tensor:
        total = batch["attention_mask"].sum()
        return total if self.as_tensor else int(total)


def batches(n: int, batch_size: int = 4, length: int = 10) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(n):
        mask = torch.zeros(batch_size, length, dtype=torch.int64)
        for row in range(batch_size):
            mask[row, : 3 + (i + row) % length] = 1
        out.append({"attention_mask": mask})
    return out


def test_a_transformer_costs_6n_plus_12_lhqt_per_token_without_its_embedding_tables():
    model = tiny_bert()
    assert transformer_shape(model) == (2, 4, 8)
    tables = (120 + 64) * 32
    assert dense_parameters(model) == sum(p.numel() for p in model.parameters()) - tables
    # A language model's output layer tied to its input table does matrix products: it counts.
    tied = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50, bias=False))
    tied[1].weight = tied[0].weight
    assert dense_parameters(tied) == 400
    assert transformer_shape(nn.Linear(3, 3)) is None


@pytest.mark.parametrize("as_tensor", [True, False], ids=["device-tensor", "int"])
def test_tokens_per_s_and_mfu_of_a_window_and_the_runs_means(as_tensor):
    acc = Accelerator(cpu=True)
    model = tiny_bert()
    peak = 2e9
    throughput = Throughput(acc, CountingTask(as_tensor), model, global_batch=4, peak_flops=peak)
    drawn = batches(6)
    assert list(throughput.counted(drawn[:3])) == drawn[:3]  # the batches themselves, in order
    tokens = sum(int(b["attention_mask"].sum()) for b in drawn[:3])
    taken = throughput.take_tokens()
    assert int(taken) == tokens and int(throughput.tokens) == 0  # counting goes on in a new tensor
    first = throughput.window(3, 2.0, float(taken))
    per_token = 6 * dense_parameters(model) + 12 * 2 * 4 * 8 * (tokens / 12)  # T: tokens per sample
    assert first[SAMPLES_PER_S] == pytest.approx(12 / 2.0)
    assert first[TOKENS_PER_S] == pytest.approx(tokens / 2.0)
    assert first[MFU] == pytest.approx(tokens * per_token / 2.0 / peak)
    list(throughput.counted(drawn[3:]))  # the next window starts from zero
    later = sum(int(b["attention_mask"].sum()) for b in drawn[3:])
    second = throughput.window(3, 6.0, float(throughput.take_tokens()))
    assert second[TOKENS_PER_S] == pytest.approx(later / 6.0)
    # The run's means weigh the windows by their time: totals over total seconds.
    means = throughput.means()
    assert means[SAMPLES_PER_S] == pytest.approx(24 / 8.0)
    assert means[TOKENS_PER_S] == pytest.approx((tokens + later) / 8.0)
    assert throughput.summary().startswith(f"mean 3 samples/s, {(tokens + later) / 8.0:.0f} tokens/s, MFU ")


def test_without_tokens_or_a_known_peak_mfu_is_null_and_samples_per_s_remains():
    acc = Accelerator(cpu=True)
    assert acc.peak_flops() is None  # a CPU is in no table
    throughput = Throughput(acc, object(), nn.Linear(4, 2), global_batch=8, peak_flops=None)
    assert throughput.count_tokens is None and throughput.take_tokens() is None
    assert throughput.window(5, 4.0, None) == {SAMPLES_PER_S: 10.0, MFU: None}
    assert throughput.summary() == "mean 10 samples/s, MFU n/a"
    # Without tokens, a known peak gives MFU by samples: 6 FLOPs per parameter and sample.
    counted = Throughput(acc, object(), nn.Linear(4, 2), global_batch=8, peak_flops=1e3)
    assert counted.window(5, 4.0, None)[MFU] == pytest.approx(10.0 * 6 * 10 / 1e3)
