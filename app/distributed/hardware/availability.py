"""Accelerate's ``is_*_available`` helpers: what this installation and this runtime can use.

Answers describe *our* runtime: ``is_fp16_available()`` is False without CUDA because our fp16 (loss
scaling) needs a CUDA device; bf16 runs everywhere (CPU autocast).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable

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


# The rest of accelerate.utils' is_*_available, answering for this environment: an optional package
# is available when it is installed; a capability this runtime does not offer (DeepSpeed-like
# integrations, fp8 recipes, pipeline parallelism) is not, whatever is installed.


def _installed(package: str) -> Callable[..., bool]:
    def available(*args: object, **kwargs: object) -> bool:
        return _package(package)

    available.__name__ = f"is_{package}_available"
    available.__doc__ = f"Whether the {package} package is installed."
    return available


is_4bit_bnb_available = is_8bit_bnb_available = is_bitsandbytes_multi_backend_available = _installed("bitsandbytes")
is_aim_available = _installed("aim")
is_amdsmi_available = _installed("amdsmi")
is_boto3_available = _installed("boto3")
is_clearml_available = _installed("clearml")
is_comet_ml_available = _installed("comet_ml")
is_dvclive_available = _installed("dvclive")
is_import_timer_available = _installed("import_timer")
is_lomo_available = _installed("lomo_optim")
is_matplotlib_available = _installed("matplotlib")
is_mlflow_available = _installed("mlflow")
is_pandas_available = _installed("pandas")
is_peft_available = _installed("peft")
is_pynvml_available = _installed("pynvml")
is_sagemaker_available = _installed("sagemaker")
is_schedulefree_available = _installed("schedulefree")
is_swanlab_available = _installed("swanlab")
is_timm_available = _installed("timm")
is_torchdata_available = _installed("torchdata")
is_torchvision_available = _installed("torchvision")
is_trackio_available = _installed("trackio")
is_triton_available = _installed("triton")
# fp8 recipes and pipeline parallelism are not offered here (is_fp8_available is False).
is_msamp_available = is_transformer_engine_available = is_transformer_engine_mxfp8_available = _never
is_torchao_available = is_pippy_available = _never


def is_weights_only_available() -> bool:
    """torch.load(weights_only=True) exists (torch >= 1.13; checkpoints here never unpickle anyway)."""
    return "weights_only" in inspect.signature(torch.load).parameters


def is_xccl_available() -> bool:
    """Intel's XPU collective library in this torch build."""
    return bool(getattr(torch.distributed, "is_xccl_available", lambda: False)())


def is_rich_available() -> bool:
    """rich installed and asked for, as Accelerate has it (ACCELERATE_ENABLE_RICH=1)."""
    import os

    return _package("rich") and os.environ.get("ACCELERATE_ENABLE_RICH", "").lower() in ("1", "true", "yes", "on")
