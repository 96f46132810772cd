"""The names Accelerate scripts import from ``accelerate.utils``, laid out so that

    from accelerate.utils import DistributedType, gather, set_seed

becomes

    from app.distributed.utils import DistributedType, gather, set_seed

The functional operations act on the live process group (``state.py``); the configuration objects
are those ``Accelerator`` takes.
"""

from __future__ import annotations

from torch import nn

from app.distributed.configuration import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    KwargsHandler,
    ProjectConfiguration,
)
from app.distributed.functional import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    copy_tensor_to_devices,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
    synchronize_rng_state,
    synchronize_rng_states,
)
from app.distributed.hardware.availability import (
    is_4bit_bnb_available,
    is_8bit_bnb_available,
    is_aim_available,
    is_amdsmi_available,
    is_bf16_available,
    is_bitsandbytes_multi_backend_available,
    is_bnb_available,
    is_boto3_available,
    is_clearml_available,
    is_comet_ml_available,
    is_cuda_available,
    is_datasets_available,
    is_deepspeed_available,
    is_dvclive_available,
    is_fp8_available,
    is_fp16_available,
    is_hpu_available,
    is_import_timer_available,
    is_lomo_available,
    is_matplotlib_available,
    is_megatron_lm_available,
    is_mlflow_available,
    is_mlu_available,
    is_mps_available,
    is_msamp_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_pandas_available,
    is_peft_available,
    is_pippy_available,
    is_pynvml_available,
    is_pytest_available,
    is_rich_available,
    is_rocm_available,
    is_safetensors_available,
    is_sagemaker_available,
    is_schedulefree_available,
    is_sdaa_available,
    is_swanlab_available,
    is_tensorboard_available,
    is_timm_available,
    is_torch_xla_available,
    is_torchao_available,
    is_torchdata_available,
    is_torchdata_stateful_dataloader_available,
    is_torchvision_available,
    is_trackio_available,
    is_transformer_engine_available,
    is_transformer_engine_mxfp8_available,
    is_transformers_available,
    is_triton_available,
    is_wandb_available,
    is_weights_only_available,
    is_xccl_available,
    is_xpu_available,
)
from app.distributed.hardware.kinds import DistributedType, RNGType
from app.distributed.launchers import notebook_launcher
from app.distributed.local_sgd import LocalSGD
from app.distributed.memory import find_executable_batch_size
from app.distributed.placeholders import DummyOptim, DummyScheduler
from app.distributed.profiling import ProfileKwargs
from app.distributed.random import set_seed
from app.distributed.state import live_backend


def wait_for_everyone() -> None:
    """Block until every process reaches this point."""
    live_backend().barrier()


def extract_model_from_parallel(model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
    """The user's module inside a DDP (or ``torch.compile``) wrapper."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model._orig_mod
        model = inner  # type: ignore[assignment]
    return model


__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "GradientAccumulationPlugin",
    "KwargsHandler",
    "LocalSGD",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "broadcast",
    "broadcast_object_list",
    "copy_tensor_to_devices",
    "extract_model_from_parallel",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_amdsmi_available",
    "is_bf16_available",
    "is_bitsandbytes_multi_backend_available",
    "is_bnb_available",
    "is_boto3_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp8_available",
    "is_fp16_available",
    "is_hpu_available",
    "is_import_timer_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_megatron_lm_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_msamp_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pippy_available",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_rocm_available",
    "is_safetensors_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_xpu_available",
    "notebook_launcher",
    "pad_across_processes",
    "reduce",
    "send_to_device",
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "wait_for_everyone",
]
