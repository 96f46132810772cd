"""Accelerate's ``is_*_available`` helpers: what this installation and this runtime can use.

Answers describe *our* runtime: ``is_fp16_available()`` is False without CUDA because our fp16 (loss
scaling) needs a CUDA device; bf16 runs everywhere (CPU autocast).
"""

from __future__ import annotations

import importlib.util

import torch


def _package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_mps_available(min_version: str | None = None) -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    return _package("torch_xla")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    """Whether our fp16 (autocast + loss scaling) runs on this machine's default device."""
    from app.distributed.hardware.registry import device_ops

    return "fp16" in device_ops("cuda" if is_cuda_available() else "cpu").precisions


def is_fp8_available() -> bool:
    return False


def _never(*args: object, **kwargs: object) -> bool:
    return False


is_hpu_available = is_npu_available = is_mlu_available = is_sdaa_available = is_musa_available = _never
is_neuron_available = is_rocm_available = is_deepspeed_available = is_megatron_lm_available = _never


def is_datasets_available() -> bool:
    return _package("datasets")


def is_transformers_available() -> bool:
    return _package("transformers")


def is_tensorboard_available() -> bool:
    return _package("tensorboard")


def is_wandb_available() -> bool:
    return _package("wandb")


def is_pytest_available() -> bool:
    return _package("pytest")


def is_bnb_available(min_version: str | None = None) -> bool:
    return _package("bitsandbytes")


def is_safetensors_available() -> bool:
    return _package("safetensors")


def is_torchdata_stateful_dataloader_available() -> bool:
    return False
