"""Run one of Accelerate's own distributed test scripts with every ``accelerate`` import resolved to
``app.distributed``, and write what each of its checks did.

    python tests/helpers/accelerate_runner.py test_ops OUT.json            # one process
    torchrun --nproc_per_node=2 tests/helpers/accelerate_runner.py test_ops OUT.json

The scripts ship in the ``accelerate`` wheel (a test-only dependency): they are read from its files,
never imported through the package. ``sys.modules`` maps each ``accelerate`` module a script names
to ours; anything else under ``accelerate`` fails to import (a finder refuses it), so no code of the
real package runs. ``accelerate.test_utils`` (the scripts' fixtures: a regression dataset and
model, two assertion helpers) is provided here; the dataset and model come from the wheel's
``test_utils/training.py``, which is plain torch/numpy.

Each check (a function ``main()`` calls, listed in CHECKS) is wrapped: it is recorded as passed,
failed (with the error) or excluded (not run, with the reason from EXCLUDED); a failure does not
stop the script. Every rank writes ``OUT.json.<rank>``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.metadata
import importlib.util
import json
import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CHECKS = {
    "test_script": ["init_state_check", "process_execution_check", "test_split_between_processes_list",
                    "test_split_between_processes_nested_dict", "test_split_between_processes_tensor",
                    "test_split_between_processes_evenly", "test_split_between_processes_dataset",
                    "rng_sync_check", "dl_preparation_check", "central_dl_preparation_check", "custom_sampler_check",
                    "check_seedable_sampler", "check_seedable_sampler_with_data_seed",
                    "check_seedable_sampler_in_batch_sampler_shard", "training_check", "test_trigger",
                    "test_reinstantiated_state"],
    "test_ops": ["test_gather", "test_gather_object", "test_gather_non_contiguous", "test_broadcast",
                 "test_pad_across_processes", "test_reduce_sum", "test_reduce_mean", "test_reduce_max",
                 "test_op_checker", "test_copy_tensor_to_devices"],
    "test_sync": ["test_dataloader_break", "test_noop_sync", "test_distributed_sync",
                  "test_distributed_sync_multiple_fwd", "test_gradient_accumulation",
                  "test_gradient_accumulation_with_opt_and_scheduler"],
    "test_distributed_data_loop": ["test_default_ensures_even_batch_sizes", "test_can_disable_even_batches",
                                   "test_can_join_uneven_inputs", "test_join_can_override_even_batches",
                                   "test_join_can_override_for_mixed_type_dataloaders",
                                   "test_join_raises_warning_for_iterable_when_overriding_even_batches",
                                   "test_join_raises_warning_for_non_ddp_distributed", "test_pickle_accelerator",
                                   "test_data_loader", "test_stateful_dataloader",
                                   "test_stateful_dataloader_save_state"],
    "test_notebook": ["test_can_initialize", "test_clean_cuda_fork", "test_static_rdzv_backend",
                      "test_c10d_rdzv_backend", "test_fault_tolerant", "test_monitoring", "test_problematic_imports"],
}

EXCLUDED = {
    "test_fault_tolerant": "racy by design, under Accelerate too: a restarted attempt can leave one process "
                           "returning early (empty queue) while the other's PartialState() waits in the process "
                           "group for it (seen here: a 5-minute stall on a loaded machine)",
    "test_reinstantiated_state": "Accelerate internals: after AcceleratorState._reset_state() it expects prepare() "
                                 "of an existing Accelerator to fail; ours owns its state and keeps working",
}

ALIASES = {
    "accelerate": "app.distributed",
    "accelerate.accelerator": "app.distributed",
    "accelerate.state": "app.distributed.state",
    "accelerate.data_loader": "app.distributed.data_loader",
    "accelerate.utils": "app.distributed.utils",
    "accelerate.utils.dataclasses": "app.distributed.utils",
    "accelerate.utils.operations": "app.distributed.utils",
    "accelerate.utils.random": "app.distributed.utils",
    "accelerate.utils.memory": "app.distributed.utils",
}


class RefuseRealAccelerate(importlib.abc.MetaPathFinder):
    """Any ``accelerate`` module not aliased above would load the real package: refuse it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "accelerate" or name.startswith("accelerate."):
            raise ImportError(f"{name} is not mapped to app.distributed (conformance runner)")


def wheel_file(relative: str) -> Path:
    return Path(str(importlib.metadata.distribution("accelerate").locate_file(f"accelerate/{relative}")))


def install_aliases() -> None:
    import importlib as il

    for name, target in ALIASES.items():
        sys.modules[name] = il.import_module(target)
    sys.modules["accelerate.test_utils"] = sys.modules["accelerate.test_utils.testing"] = test_utils_module()
    sys.meta_path.insert(0, RefuseRealAccelerate())


def test_utils_module() -> types.ModuleType:
    import torch

    from app.distributed.utils import gather

    module = types.ModuleType("accelerate.test_utils")
    training = load_file("accelerate.test_utils.training", wheel_file("test_utils/training.py"))
    module.RegressionDataset = training.RegressionDataset  # type: ignore[attr-defined]
    module.RegressionModel = training.RegressionModel  # type: ignore[attr-defined]

    def are_the_same_tensors(tensor: torch.Tensor) -> bool:
        gathered = gather(tensor[None].clone())
        return all(torch.equal(gathered[0], t) for t in gathered)

    @contextlib.contextmanager
    def assert_exception(exception_class: type[BaseException], msg: str | None = None) -> Any:
        try:
            yield
        except exception_class as error:
            assert msg is None or msg in str(error), f"expected {msg!r} in {error}"
        else:
            raise AssertionError(f"{exception_class.__name__} was not raised")

    import pytest

    module.are_the_same_tensors = are_the_same_tensors  # type: ignore[attr-defined]
    module.assert_exception = assert_exception  # type: ignore[attr-defined]
    module.require_bnb = pytest.mark.skipif(True, reason="bitsandbytes")  # type: ignore[attr-defined]
    sys.modules["accelerate.test_utils.training"] = training
    return module


def load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run(script: str, out: Path) -> None:
    rank = int(os.environ.get("RANK", "0"))
    records: list[dict[str, Any]] = []
    report = {"script": script, "rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")), "checks": records}

    def write() -> None:
        Path(f"{out}.{rank}").write_text(json.dumps(report, indent=1))

    try:
        install_aliases()
        module = load_file(f"accelerate_script_{script}", wheel_file(f"test_utils/scripts/{script}.py"))
    except Exception as error:  # noqa: BLE001 - the script cannot even import: every check is not run
        report["import_error"] = f"{type(error).__name__}: {error}"
        write()
        return
    for name in CHECKS[script]:
        setattr(module, name, recorded(getattr(module, name), name, records))
    try:
        module.main()
    except Exception as error:  # noqa: BLE001 - recorded, like a failed check
        report["main_error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
    report["not_called"] = [n for n in CHECKS[script] if not any(r["check"] == n for r in records)]
    write()


def recorded(function: Any, name: str, records: list[dict[str, Any]]) -> Any:
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        label = name + (f" #{calls[0]}" if calls[0] > 1 else "") + (f"({', '.join(f'{k}={v}' for k, v in kwargs.items())})" if kwargs else
                        f"({', '.join(repr(a) for a in args if isinstance(a, (bool, int, str)))})"
                        if any(isinstance(a, (bool, int, str)) for a in args) else "")
        skip = [m for m in getattr(function, "pytestmark", []) if m.name == "skipif" and m.args and m.args[0]]
        if skip:  # the script's own pytest condition (main() calls the function regardless)
            records.append({"check": name, "label": label, "status": "skipped by the script",
                            "reason": skip[0].kwargs.get("reason", "")})
            return None
        if name in EXCLUDED:
            records.append({"check": name, "label": label, "status": "excluded", "reason": EXCLUDED[name]})
            return None
        try:
            result = function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a failed check is recorded; the script goes on
            records.append({"check": name, "label": label, "status": "failed",
                            "error": "".join(traceback.format_exception(type(error), error, error.__traceback__))[-3000:]})
            return None
        records.append({"check": name, "label": label, "status": "passed"})
        return result

    return wrapper


if __name__ == "__main__":
    run(sys.argv[1], Path(sys.argv[2]))
