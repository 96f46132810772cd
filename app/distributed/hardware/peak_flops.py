"""Peak FLOP/s of common accelerators, for the model FLOPs utilisation (MFU) the training log shows:
one chip's dense (no sparsity) tensor-core throughput by compute type, from the vendors' data sheets,
looked up by the device name the backend reports (``DeviceOps.device_name``: ``torch.cuda``'s
``NVIDIA H100 80GB HBM3``, XLA's ``TPU v5 lite``). A name not in the table (a CPU among them) has
no peak, and the run's MFU is null.

TPUs run matrix products in bf16 whatever the tensors' type (XLA's default precision), so a TPU has
one figure for every precision (as Lightning's ``ThroughputMonitor`` counts them). Torch-free.
"""

from __future__ import annotations

import re

T = 1e12

# (pattern on the lower-cased device name, {compute type: FLOP/s}); the first match wins, so a more
# specific name comes before the one it contains (H100 NVL before H100, L40S before L4).
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    # NVIDIA H100 / H200 data sheets (SXM unless named): bf16 = fp16 dense.
    (r"h100.*nvl", {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T}),
    (r"h100.*pcie", {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T}),
    (r"h100", {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T}),
    (r"h200.*nvl", {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T}),
    (r"h200", {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T}),
    (r"a100", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T}),
    (r"l40s", {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362 * T, "fp16": 362 * T}),
    (r"\bl4\b", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T}),
    # The A10 itself: AWS's A10G is another chip (not in the table).
    (r"\ba10\b", {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T}),
    # Volta and Turing have no bf16 tensor cores: a bf16 run there has no peak to compare with.
    (r"v100.*pcie", {"fp32": 14 * T, "fp16": 112 * T}),
    (r"v100", {"fp32": 15.7 * T, "fp16": 125 * T}),
    (r"\bt4\b", {"fp32": 8.1 * T, "fp16": 65 * T}),
)

# Google Cloud TPU system architecture pages: bf16 peak per chip.
TPU_PEAKS: tuple[tuple[str, float], ...] = (
    (r"v6\s*(e|lite)", 918 * T),
    (r"v5\s*(e|lite)", 197 * T),
    (r"v5\s*p|v5$", 459 * T),
    (r"v4", 275 * T),
    (r"v3", 123 * T),
    (r"v2", 45 * T),
)


def compute_type(precision: str, float32_matmul_precision: str = "highest") -> str:
    """What the matrix products of a run compute in: its autocast type (``bf16``, ``fp16``), else
    fp32, or TF32 where torch lets fp32 matrix products use it (``torch.set_float32_matmul_precision``
    "high" or "medium")."""
    if precision in ("bf16", "fp16"):
        return precision
    return "fp32" if float32_matmul_precision == "highest" else "tf32"


def peak_flops(device_name: str | None, kind: str) -> float | None:
    """One chip's peak FLOP/s for compute type ``kind`` (see :func:`compute_type`), or None when the
    device or that type is not in the table."""
    if not device_name:
        return None
    name = device_name.lower()
    if "tpu" in name:
        return next((peak for pattern, peak in TPU_PEAKS if re.search(pattern, name)), None)
    for pattern, peaks in GPU_PEAKS:
        if re.search(pattern, name):
            return peaks.get(kind)
    return None
