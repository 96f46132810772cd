"""``app.distributed.utils`` against the installed ``accelerate`` wheel's ``accelerate.utils`` (a
test-only dependency): every ``is_*_available`` is exported here, answering for this environment as
Accelerate's does where it describes an installed package; every other public name is exported or
left out on purpose, for a reason listed below (a new Accelerate name fails this test until one of
the two is decided)."""

from __future__ import annotations

import re
import subprocess
import sys
import types

import pytest

from tests.conftest import REPO

accelerate_utils = pytest.importorskip("accelerate.utils")

# Deliberate omissions: (reason, pattern over the name).
OMITTED = [
    ("DeepSpeed, Megatron-LM, SageMaker, TPU pods and Habana: integrations this runtime does not offer",
     (r"(?i)deepspeed|megatron|sagemaker|sagemager|TrainStep|habana|install_xla|prepare_tpu|GatheredParameters|"
     r"avg_losses_across_data_parallel_group")),
    ("fp8 recipes and quantized layers: no fp8 or bitsandbytes path here (is_fp8_available is False)",
     (r"(?i)fp8|msamp|TERecipe|AORecipe|torchao|transformer_engine|bnb|quantiz|CustomDtype|"
     r"filter_first_and_last_linear_layers|has_ao_layers")),
    ("big-model inference (device maps, offloading, module sizes, tied weights): not training",
     (r"(?i)offload|device_map|max_memory|balanced_memory|module_sizes|maximum_sizes|max_layer_size|tied|retie|"
     r"set_module_tensor|named_module_tensors|align_module_device|load_checkpoint_in_model|dtype_byte_size|"
     r"convert_file_size|convert_bytes|id_tensor_storage|PrefixedDataset|extract_submodules_state_dict|"
     r"get_module_children|find_device|convert_model$")),
    ("Accelerate's FSDP1 plugin and FSDP2/tensor/context-parallel helpers: FSDP2 is hardware=fsdp here",
     (r"(?i)fsdp|FullyShardedDataParallelPlugin|model_has_dtensor|ParallelismConfig|TensorParallel|"
     r"ContextParallel|get_model_tp_size")),
    ("the accelerate CLI's config and launch plumbing (python -m app and notebook_launcher launch here)",
     (r"(?i)launch|environment|env_variables|_cmd_env|prepare_multi_gpu_env|write_basic_config|"
     r"ComputeEnvironment|parse_flag_from_env|parse_choice_from_env|get_int_from_env|str_to_bool|"
     r"set_numa_affinity|get_cpu_distributed_information|get_gpu_info|check_cuda_p2p_ib_support|"
     r"check_os_kernel|is_port_in_use|are_libraries_initialized|DistributedType|LoggerType|PrecisionType|"
     r"DynamoBackend|get_current_device_type|is_torch_version|compare_versions|PROFILING_AVAILABLE")),
    ("pickled checkpoint files and their names: checkpoints here are safetensors and JSON with a manifest",
     r"_NAME$|^(save|load|load_state_dict|clean_state_dict_for_safetensors|SCALER_NAME)$"),
    ("torch.compile region helpers and the dynamo plugin: trainer.compile compiles the whole model",
     r"(?i)compile|dynamo"),
    ("kwargs handlers refused in one sentence here (docs/accelerate.md), and GradScaler access",
     (r"^(GradScalerKwargs|InitProcessGroupKwargs|get_grad_scaler|"
     r"get_mixed_precision_context_manager)$")),
    ("tensor-tree and misc helpers internal to Accelerate's operations (ours are private)",
     (r"^(recursively_apply|honor_type|listify|find_batch_size|ignorant_find_batch_size|get_data_structure|"
     r"initialize_tensors|is_namedtuple|is_tensor_information|is_torch_tensor|TensorInformation|"
     r"TORCH_DISTRIBUTED_OPERATION_TYPES|CannotPadNestedTensorWarning|concatenate|slice_tensors|"
     r"pad_input_tensors|convert_outputs_to_fp32|convert_to_fp32|merge_dicts|recursive_getattr|"
     r"get_pretty_name|release_memory|is_peft_model|tqdm|AbstractTrainStep)$")),
]


def public_names(module: types.ModuleType) -> set[str]:
    return {n for n in getattr(module, "__all__", dir(module))
            if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)}


def test_every_accelerate_utils_name_is_ours_or_a_listed_omission():
    import app.distributed.utils as ours

    theirs = public_names(accelerate_utils)
    available = sorted(n for n in theirs if re.fullmatch(r"is_\w+_available", n))
    assert [n for n in available if not hasattr(ours, n)] == []  # every one, no omission allowed
    missing = sorted(n for n in theirs - public_names(ours) if n not in available)
    unexplained = [n for n in missing if not any(re.search(pattern, n) for _, pattern in OMITTED)]
    assert unexplained == [], f"accelerate.utils names neither exported nor listed as omitted: {unexplained}"
    # And the list names only what is really left out: nothing exported here matches an omission.
    exported_but_listed = sorted(n for n in theirs & public_names(ours) if n not in available
                                 and any(re.search(pattern, n) for _, pattern in OMITTED[:-1]))
    assert set(exported_but_listed) <= {"DistributedType"}, exported_but_listed


def test_package_availability_answers_as_accelerates_for_this_environment():
    import app.distributed.utils as ours

    # Those that only ask whether a package is installed (the others describe our runtime: fp16,
    # fp8, DeepSpeed-like integrations, devices).
    for name in ("is_schedulefree_available", "is_matplotlib_available", "is_pandas_available",
                 "is_peft_available", "is_torchvision_available", "is_rich_available", "is_mlflow_available",
                 "is_tensorboard_available", "is_wandb_available", "is_datasets_available",
                 "is_transformers_available", "is_timm_available", "is_boto3_available"):
        assert getattr(ours, name)() == bool(getattr(accelerate_utils, name)()), name
    assert ours.is_weights_only_available() is True


# Accelerate's examples/by_feature/schedule_free.py opens so, its imports rewritten as docs/accelerate.md says:
# without schedulefree it stops with its own ImportError, as under Accelerate; with it, it goes on.
SCHEDULE_FREE_HEADER = """
from app.distributed import Accelerator, DistributedType
from app.distributed.utils import is_schedulefree_available

if is_schedulefree_available():
    import schedulefree
    print("schedulefree", schedulefree.__name__)
else:
    raise ImportError(
        "This example requires the `schedulefree` library. Please install it with `pip install schedulefree`"
    )
"""


@pytest.mark.timeout(120)
def test_the_schedule_free_examples_imports_take_accelerates_path():
    proc = subprocess.run([sys.executable, "-c", SCHEDULE_FREE_HEADER], capture_output=True, text=True,
                          cwd=REPO, timeout=110, check=False)
    if bool(accelerate_utils.is_schedulefree_available()):
        assert proc.returncode == 0 and "schedulefree schedulefree" in proc.stdout, proc.stderr[-2000:]
    else:
        assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
            "ImportError: This example requires the `schedulefree` library. Please install it with "
            "`pip install schedulefree`"), proc.stderr[-2000:]
