"""Every argument of the Accelerator has an effect or is refused in one sentence: none is accepted and
dropped. One case per optional argument of the constructor and of each public method (a new one
without a case fails ``test_every_argument_has_a_case``); the few whose effect needs two processes
name the multi-process test that shows it.
"""

from __future__ import annotations

import ast
import inspect
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from app.distributed import Accelerator, Backend
from app.distributed.checkpoint.errors import CheckpointError
from app.distributed.precision import Fp16Precision
from app.distributed.profiling import ProfileKwargs
from app.distributed.utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)

TESTS = Path(__file__).resolve().parent


def data(n: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(float(n)).unsqueeze(1), torch.arange(n)), batch_size=2)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1, 2)


def refused(sentence_start: str, make: Callable[[], object]) -> None:
    """``make()`` raises ValueError with one sentence beginning with ``sentence_start``."""
    with pytest.raises(ValueError) as err:
        make()
    message = str(err.value)
    assert message.startswith(sentence_start) and message.endswith(".") and "\n" not in message, message


def meta_accelerator(**kwargs: object) -> Accelerator:
    """A runtime whose device is not the CPU (the meta device), so placement shows on a CPU machine."""
    return Accelerator(backend=Backend(torch.device("meta")), **kwargs)  # type: ignore[arg-type]


def syncs(acc: Accelerator, micro_steps: int) -> list[bool]:
    seen = []
    for _ in range(micro_steps):
        with acc.accumulate():
            seen.append(acc.sync_gradients)
    return seen


def epoch(loader: object) -> list[list[int]]:
    return [batch[1].tolist() for batch in loader]  # type: ignore[attr-defined]


# -- the constructor ---------------------------------------------------------------------------------------
def c_device_placement(tmp_path: Path) -> None:
    assert next(iter(meta_accelerator().prepare(data())))[0].device.type == "meta"
    assert next(iter(meta_accelerator(device_placement=False).prepare(data())))[0].device.type == "cpu"


def c_mixed_precision(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    with acc.autocast():
        assert acc.mixed_precision == "bf16" and torch.is_autocast_enabled("cpu")
    refused("precision=fp16 needs a CUDA GPU", lambda: Accelerator(cpu=True, mixed_precision="fp16"))


def c_gradient_accumulation_steps(tmp_path: Path) -> None:
    assert syncs(Accelerator(cpu=True, gradient_accumulation_steps=2), 4) == [False, True, False, True]
    refused("gradient_accumulation_steps must be >= 1", lambda: Accelerator(cpu=True, gradient_accumulation_steps=0))


def c_cpu(tmp_path: Path) -> None:
    assert Accelerator(cpu=True).device.type == "cpu"
    refused("pass backend= or cpu=True, not both", lambda: Accelerator(cpu=True, backend=Backend(torch.device("cpu"))))


def c_dataloader_config(tmp_path: Path) -> None:
    def order(seed: int) -> list[list[int]]:
        config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed)
        return epoch(Accelerator(cpu=True, dataloader_config=config).prepare(
            DataLoader(TensorDataset(torch.zeros(8), torch.arange(8)), batch_size=2, shuffle=True)))

    assert order(3) == order(3) != order(4)  # shuffled from data_seed + epoch
    refused("pass split_batches/even_batches or dataloader_config, not both",
            lambda: Accelerator(cpu=True, even_batches=False, dataloader_config=DataLoaderConfiguration()))


def c_project_dir(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_dir=tmp_path / "project")
    assert acc.save_state() == tmp_path / "project" / "checkpoints" / "checkpoint_0"


def c_project_config(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path / "p"), total_limit=1,
                                                                     logging_dir=str(tmp_path / "logs")))
    acc.save_state()
    acc.save_state()
    assert [p.name for p in (tmp_path / "p" / "checkpoints").iterdir()] == ["checkpoint_1"]
    acc = Accelerator(cpu=True, log_with="jsonl", project_config=ProjectConfiguration(
        project_dir=str(tmp_path / "q"), logging_dir=str(tmp_path / "logs")))
    acc.init_trackers("test")
    acc.log({"x": 1}, step=1)
    assert (tmp_path / "logs" / "metrics.jsonl").exists()  # the trackers write in logging_dir
    refused("ProjectConfiguration(save_on_each_node=True) is not supported",
            lambda: Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=True)))
    refused("project_dir=", lambda: Accelerator(cpu=True, project_dir=tmp_path / "a",
                                                project_config=ProjectConfiguration(project_dir=str(tmp_path / "b"))))


def c_gradient_accumulation_plugin(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert syncs(acc, 3) == [False, False, True]
    refused("pass gradient_accumulation_steps or gradient_accumulation_plugin, not both", lambda: Accelerator(
        cpu=True, gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2)))


def c_log_with(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with=["jsonl"])
    acc.init_trackers("test")
    acc.log({"x": 2.5}, step=3)
    acc.end_training()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "x": 2.5}


def c_step_scheduler_with_optimizer(tmp_path: Path) -> None:
    def scheduler_steps(with_optimizer: bool) -> int:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2, step_scheduler_with_optimizer=with_optimizer)
        net = model()
        optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
        net, optimizer, scheduler = acc.prepare(net, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
        with warnings.catch_warnings():  # torch warns of a scheduler step before any optimizer step: the point
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(4):
                with acc.accumulate(net):
                    optimizer.step()
                    scheduler.step()
        return scheduler.scheduler.last_epoch

    assert (scheduler_steps(True), scheduler_steps(False)) == (2, 4)


def c_rng_types(tmp_path: Path) -> None:
    assert Accelerator(cpu=True, rng_types=["generator"]).rng_types == ["generator"]
    refused("rng_types=['torch'] is not supported", lambda: Accelerator(cpu=True, rng_types=["torch"]))


def c_kwargs_handlers(tmp_path: Path) -> None:
    seen: list[bool] = []
    net = nn.Linear(2, 2)
    net.register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)]).prepare(net)(
        torch.ones(1, 2))
    assert seen == [False]  # the prepared forward runs without autocast (ProfileKwargs: m_profile_handler)
    refused("kwargs_handlers: DistributedDataParallelKwargs is given twice", lambda: Accelerator(
        cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(), DistributedDataParallelKwargs()]))

    class GradScalerKwargs:  # Accelerate's name
        pass

    refused("kwargs_handlers: GradScalerKwargs is not supported by app.distributed",
            lambda: Accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs()]))


def c_downcast_bf16(tmp_path: Path) -> None:
    refused("downcast_bf16=True is not supported", lambda: Accelerator(cpu=True, downcast_bf16=True))


def c_backend(tmp_path: Path) -> None:
    assert meta_accelerator().device.type == "meta"


def c_seed(tmp_path: Path) -> None:
    def order(seed: int) -> list[list[int]]:
        loader = DataLoader(TensorDataset(torch.zeros(8), torch.arange(8)), batch_size=2, shuffle=True)
        return epoch(Accelerator(cpu=True, seed=seed).prepare(loader))

    assert order(5) == order(5) != order(6)


# -- the methods -----------------------------------------------------------------------------------------
def m_autocast_handler(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    with acc.autocast(autocast_handler=AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
    with acc.autocast(AutocastKwargs(cache_enabled=False)):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()


def m_backward_kwargs(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    net = acc.prepare(model())
    loss = net(torch.ones(1, 1)).sum()
    acc.backward(loss, retain_graph=True)
    acc.backward(loss)  # possible only because the first backward kept the graph


def m_backward_num_items(tmp_path: Path) -> None:
    """Summed losses with their items: the accumulated gradient is the mean over the step's 8 samples,
    however unevenly the micro-batches hold them (3 micro-batches of 1, 2 and 5), as one batch of 8 gives
    (where the loss is divided before its backward, not the gradients after)."""
    x, y = torch.linspace(-1, 1, 8).unsqueeze(1), torch.arange(8) % 2

    def gradient(sizes: list[int]) -> torch.Tensor:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=len(sizes))
        net = acc.prepare(model())
        acc.prepare(torch.optim.SGD(net.parameters(), lr=0.1))
        start = 0
        for size in sizes:
            with acc.accumulate(net):
                losses = nn.functional.cross_entropy(net(x[start:start + size]), y[start:start + size], reduction="none")
                acc.backward(losses.sum(), num_items=size if size != 2 else torch.tensor(size))  # int or tensor
                start += size
        return net.weight.grad.clone()

    mean = gradient([8])
    plain = model()
    nn.functional.cross_entropy(plain(x), y).backward()
    assert torch.allclose(mean, plain.weight.grad, rtol=1e-6, atol=1e-7)
    assert torch.allclose(gradient([1, 2, 5]), mean, rtol=1e-6, atol=1e-7)


def m_clip_grad_norm_norm_type(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    weight = nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, -4.0])
    assert float(acc.clip_grad_norm_([weight], max_norm=100.0, norm_type=1.0)) == pytest.approx(7.0)


def m_get_state_dict_unwrap(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    net = acc.prepare(model())
    assert set(acc.get_state_dict(net, unwrap=True)) == {"weight", "bias"}
    refused("get_state_dict(unwrap=False) is not supported", lambda: acc.get_state_dict(net, unwrap=False))


def m_get_tracker_unwrap(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with="jsonl")
    acc.init_trackers("test")
    assert acc.get_tracker("jsonl").name == "jsonl"
    assert acc.get_tracker("jsonl", unwrap=True).name == str(tmp_path / "metrics.jsonl")  # the open file itself
    acc.end_training()


def m_init_trackers_and_log(tmp_path: Path) -> None:
    """init_trackers' config and init_kwargs, log's step and log_kwargs, read back from TensorBoard's file."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with=["tensorboard", "jsonl"])
    acc.init_trackers("test", config={"lr": 0.5}, init_kwargs={"tensorboard": {"filename_suffix": ".mine"}})
    acc.log({"loss": 1.5}, step=7, log_kwargs={"tensorboard": {"walltime": 1234.0}})
    refused("log_kwargs for the jsonl tracker: it takes no arguments (flush)",
            lambda: acc.log({"loss": 1.0}, step=8, log_kwargs={"jsonl": {"flush": True}}))
    acc.end_training()
    [events_file] = (tmp_path / "tensorboard").glob("*.mine")
    events = list(EventFileLoader(str(events_file)).Load())
    scalar = next(e for e in events if e.summary.value and e.summary.value[0].tag == "loss")
    assert (scalar.step, scalar.wall_time) == (7, 1234.0)
    text = next(e for e in events if e.summary.value and e.summary.value[0].tag.startswith("config"))
    assert b'"lr": 0.5' in text.summary.value[0].tensor.string_val[0]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0]) == {"step": 7, "loss": 1.5}


def m_load_state_input_dir_and_config_hash(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_dir=tmp_path)
    net = acc.prepare(model())
    first = acc.save_state(metadata={"config_hash": "abc"})
    with torch.no_grad():
        net.weight.add_(1.0)
    acc.save_state(metadata={"config_hash": "abc"})
    acc.load_state(first, config_hash="abc")  # that checkpoint, not the newest
    assert torch.equal(net.weight, model().weight)
    with pytest.raises(CheckpointError, match="config"):
        acc.load_state(first, config_hash="another")


def m_save_state(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_dir=tmp_path)
    acc.prepare(model())
    folder = acc.save_state(tmp_path / "here", metadata={"note": "mine"})
    assert folder == tmp_path / "here" and json.loads((folder / "manifest.json").read_text())["extra"]["note"] == "mine"
    refused("save_state writes safetensors and JSON only", lambda: acc.save_state(safe_serialization=False))


def m_save_state_async_save_and_on_complete(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_dir=tmp_path)
    net = acc.prepare(model())
    at_save = net.weight.detach().clone()
    completed: list[Path] = []
    folder = acc.save_state(async_save=True, on_complete=completed.append)
    with torch.no_grad():  # training goes on while the write is in flight: the checkpoint keeps the state of the call
        net.weight.add_(1.0)
    acc.wait_for_checkpoint()
    assert completed == [folder] and (folder / "manifest.json").exists()
    acc.load_state(folder)
    assert torch.equal(net.weight, at_save)


def m_save_weights(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_dir=tmp_path)
    net = acc.prepare(nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 2)))
    net[0].requires_grad_(False)
    at_save = [p.detach().clone() for p in net.parameters()]
    completed: list[Path] = []
    folder = acc.save_weights(net, tmp_path / "best_3", trainable_only=True, metadata={"step": 3, "note": "mine"},
                              async_save=True, on_complete=completed.append)
    with torch.no_grad():  # training goes on while the write is in flight: the folder keeps the weights of the call
        for p in net.parameters():
            p.add_(1.0)
    acc.wait_for_checkpoint()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert completed == [folder] and manifest["step"] == 3 and manifest["extra"]["note"] == "mine"
    assert sorted(manifest["files"]) == ["model.safetensors"]
    acc.load_weights(net, folder)  # the frozen layer was left out: it keeps its value
    assert [torch.equal(p, a) for p, a in zip(net.parameters(), at_save)] == [False, False, True, True]


def m_save_safe_serialization(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    acc.save({"w": torch.ones(2)}, tmp_path / "w.safetensors", safe_serialization=True)
    assert (tmp_path / "w.safetensors").stat().st_size > 0
    refused("Accelerator.save(safe_serialization=True) writes safetensors",
            lambda: acc.save({"epoch": 3}, tmp_path / "meta.json", safe_serialization=True))


def m_save_model_and_model_shards(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    net = acc.prepare(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    assert len(acc.model_shards(net, tmp_path, max_shard_size=300)) == 2
    acc.save_model(net, tmp_path / "sharded", max_shard_size=300)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    acc.save_model(net, tmp_path / "bin", safe_serialization=False)
    assert [p.name for p in (tmp_path / "bin").iterdir()] == ["pytorch_model.bin"]


def m_prepare_device_placement(tmp_path: Path) -> None:
    acc = meta_accelerator()
    loader, net = acc.prepare(data(), model(), device_placement=[False, True])
    assert next(iter(loader))[0].device.type == "cpu" and net.weight.device.type == "meta"
    refused("device_placement has 1 entries for the 2 objects passed",
            lambda: acc.prepare(data(), model(), device_placement=[True]))


def m_prepare_data_loader_device_placement(tmp_path: Path) -> None:
    acc = meta_accelerator()
    assert next(iter(acc.prepare_data_loader(data(), device_placement=False)))[0].device.type == "cpu"
    assert next(iter(acc.prepare_data_loader(data(), device_placement=True)))[0].device.type == "meta"


def m_prepare_model(tmp_path: Path) -> None:
    acc = meta_accelerator()
    assert acc.prepare_model(model(), device_placement=True).weight.device.type == "meta"
    already = nn.Linear(1, 2, device="meta")
    assert acc.prepare_model(already, device_placement=False) is already  # nothing to move
    refused("device_placement=False: the backend places and wraps the model on meta",
            lambda: acc.prepare_model(model(), device_placement=False))
    # evaluation_mode: a frozen model for inference beside the trained one, placed, not kept for checkpoints
    frozen = acc.prepare_model(model().requires_grad_(False), evaluation_mode=True)
    assert frozen.weight.device.type == "meta" and not frozen.training
    assert not any(frozen is m for m in acc._models)
    refused("prepare_model(evaluation_mode=True) takes a frozen model",
            lambda: acc.prepare_model(model(), evaluation_mode=True))


def m_prepare_optimizer_device_placement(tmp_path: Path) -> None:
    """A state the optimizer already holds follows its parameters (here their dtype; on a GPU their device)."""
    def state_dtype(place: bool) -> torch.dtype:
        net = model()
        optimizer = torch.optim.AdamW(net.parameters())
        net(torch.ones(1, 1)).sum().backward()
        optimizer.step()
        net.double()
        Accelerator(cpu=True).prepare_optimizer(optimizer, device_placement=place)
        return optimizer.state[net.weight]["exp_avg"].dtype

    assert (state_dtype(True), state_dtype(False)) == (torch.float64, torch.float32)


def m_profile_handler(tmp_path: Path) -> None:
    """Given to profile(), or in kwargs_handlers for a profile() given none."""
    def trace(folder: Path) -> ProfileKwargs:
        return ProfileKwargs(activities=["cpu"], output_trace_dir=str(folder))

    with Accelerator(cpu=True).profile(profile_handler=trace(tmp_path / "given")):
        torch.ones(2) + 1
    with Accelerator(cpu=True, kwargs_handlers=[trace(tmp_path / "handler")]).profile():
        torch.ones(2) + 1
    assert (tmp_path / "given" / "profile_0.json").exists() and (tmp_path / "handler" / "profile_0.json").exists()


def m_reduce_scale(tmp_path: Path) -> None:
    assert Accelerator(cpu=True).reduce(torch.tensor([1.5]), reduction="sum", scale=2.0).tolist() == [3.0]
    with pytest.raises(ValueError, match="reduction must be one of"):
        Accelerator(cpu=True).reduce(torch.tensor([1.5]), reduction="median")


def m_skip_first_batches_num_batches(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    assert epoch(acc.skip_first_batches(acc.prepare(data()), num_batches=3)) == [[6, 7]]


def m_expand_batches_batch_size(tmp_path: Path) -> None:
    """The samples a micro-batch holds (what the loop's throughput counts): given, or the loader's batch size."""
    acc = Accelerator(cpu=True)
    loader = acc.prepare(data())  # batches of 2

    def halves(batch, step):
        return [tuple(t[i:i + 1] for t in batch) for i in range(2)]

    assert acc.expand_batches(loader, halves, 2, list, batch_size=1).batch_size == 1
    default = acc.expand_batches(loader, halves, 2, list)
    assert default.batch_size == 2 and len(default) == 8 and [x.tolist() for x, _ in default][:2] == [[[0.0]], [[1.0]]]


def m_unscale_gradients_optimizer(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    acc.precision = Fp16Precision("cpu")  # a loss-scaling precision (fp16 itself needs CUDA)
    net = model()
    first, second = torch.optim.SGD([net.weight], lr=0.1), torch.optim.SGD([net.bias], lr=0.1)
    first, second = acc.prepare_optimizer(first), acc.prepare_optimizer(second)
    acc.backward(net(torch.ones(1, 1)).sum())
    scale = acc.precision.scaler.get_scale()
    acc.unscale_gradients(optimizer=first.optimizer)
    assert float(net.weight.grad.abs().sum()) == pytest.approx(2.0)  # unscaled: d(sum)/dw = x = 1, for 2 outputs
    assert float(net.bias.grad.abs().sum()) == pytest.approx(2.0 * scale)  # the other optimizer's: still scaled


def m_unwrap_model(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    net = acc.prepare(model())
    assert net.forward is not type(net).forward.__get__(net)  # the prepared forward runs in autocast
    assert getattr(acc.unwrap_model(net, keep_fp32_wrapper=False).forward, "__wrapped__", None) is None
    compiled = torch.compile(nn.Linear(1, 1), backend="eager")  # compiles at its first call only
    assert acc.unwrap_model(compiled, keep_torch_compile=True) is compiled
    assert acc.unwrap_model(compiled, keep_torch_compile=False) is compiled._orig_mod


def m_process_selection(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    assert acc.on_process(lambda: "ran", process_index=0)() == "ran"
    assert acc.on_process(lambda: "ran", process_index=1)() is None
    assert acc.on_local_process(local_process_index=0)(lambda: "local")() == "local"
    assert acc.on_local_process(lambda: "local", local_process_index=1)() is None


def m_print_kwargs(tmp_path: Path) -> None:
    out = tmp_path / "printed.txt"
    with out.open("w") as f:
        Accelerator(cpu=True).print("a", "b", sep="-", end="!", file=f)
    assert out.read_text() == "a-b!"


CASES: dict[str, Callable[[Path], None]] = {
    "__init__.device_placement": c_device_placement,
    "__init__.mixed_precision": c_mixed_precision,
    "__init__.gradient_accumulation_steps": c_gradient_accumulation_steps,
    "__init__.cpu": c_cpu,
    "__init__.dataloader_config": c_dataloader_config,
    "__init__.project_dir": c_project_dir,
    "__init__.project_config": c_project_config,
    "__init__.gradient_accumulation_plugin": c_gradient_accumulation_plugin,
    "__init__.log_with": c_log_with,
    "__init__.step_scheduler_with_optimizer": c_step_scheduler_with_optimizer,
    "__init__.rng_types": c_rng_types,
    "__init__.kwargs_handlers": c_kwargs_handlers,  # and m_profile_handler
    "__init__.downcast_bf16": c_downcast_bf16,
    "__init__.backend": c_backend,
    "__init__.seed": c_seed,
    "autocast.autocast_handler": m_autocast_handler,
    "backward.kwargs": m_backward_kwargs,
    "backward.num_items": m_backward_num_items,
    "clip_grad_norm_.norm_type": m_clip_grad_norm_norm_type,
    "get_state_dict.unwrap": m_get_state_dict_unwrap,
    "get_tracker.unwrap": m_get_tracker_unwrap,
    "init_trackers.config": m_init_trackers_and_log,
    "init_trackers.init_kwargs": m_init_trackers_and_log,
    "log.step": m_init_trackers_and_log,
    "log.log_kwargs": m_init_trackers_and_log,
    "load_state.input_dir": m_load_state_input_dir_and_config_hash,
    "load_state.config_hash": m_load_state_input_dir_and_config_hash,
    "save_state.output_dir": m_save_state,
    "save_state.safe_serialization": m_save_state,
    "save_state.metadata": m_save_state,
    "save_state.async_save": m_save_state_async_save_and_on_complete,
    "save_state.on_complete": m_save_state_async_save_and_on_complete,
    "save_weights.trainable_only": m_save_weights,
    "save_weights.metadata": m_save_weights,
    "save_weights.async_save": m_save_weights,
    "save_weights.on_complete": m_save_weights,
    "save.safe_serialization": m_save_safe_serialization,
    "save_model.max_shard_size": m_save_model_and_model_shards,
    "save_model.safe_serialization": m_save_model_and_model_shards,
    "model_shards.max_shard_size": m_save_model_and_model_shards,
    "prepare.device_placement": m_prepare_device_placement,
    "prepare_data_loader.device_placement": m_prepare_data_loader_device_placement,
    "prepare_model.device_placement": m_prepare_model,
    "prepare_model.evaluation_mode": m_prepare_model,
    "prepare_optimizer.device_placement": m_prepare_optimizer_device_placement,
    "profile.profile_handler": m_profile_handler,
    "reduce.reduction": m_reduce_scale,
    "reduce.scale": m_reduce_scale,
    "skip_first_batches.num_batches": m_skip_first_batches_num_batches,
    "unscale_gradients.optimizer": m_unscale_gradients_optimizer,
    "expand_batches.batch_size": m_expand_batches_batch_size,
    "unwrap_model.keep_fp32_wrapper": m_unwrap_model,
    "unwrap_model.keep_torch_compile": m_unwrap_model,
    "on_process.function": m_process_selection,
    "on_process.process_index": m_process_selection,
    "on_local_process.function": m_process_selection,
    "on_local_process.local_process_index": m_process_selection,
    "print.kwargs": m_print_kwargs,
}

# Arguments whose effect shows only with several processes: the test (file::function) that shows it.
ON_SEVERAL_PROCESSES = {
    "__init__.split_batches": "test_distributed_collectives.py::test_even_batches_false_and_split_batches",
    "__init__.even_batches": "test_distributed_collectives.py::test_even_batches_false_and_split_batches",
    "__init__.scale_scheduler_by_processes": "test_accelerate_compat.py::test_scheduler_steps_as_accelerate_unless_the_engine_chooses",
    "broadcast.from_process": "test_distributed_collectives.py::test_broadcast_and_process_control",
    "broadcast_object.from_process": "test_distributed_collectives.py::test_broadcast_and_process_control",
    "gather_for_metrics.use_gather_object": "test_distributed_collectives.py::test_gather_for_metrics_drops_exactly_the_padding",
    "join_uneven_inputs.even_batches": "test_distributed_training.py::test_no_sync_trigger_sync_and_join_uneven_inputs",
    "pad_across_processes.dim": "test_distributed_collectives.py::test_pad_across_processes",
    "pad_across_processes.pad_index": "test_distributed_collectives.py::test_pad_across_processes",
    "pad_across_processes.pad_first": "test_distributed_collectives.py::test_pad_across_processes",
    "split_between_processes.apply_padding": "test_distributed_collectives.py::test_split_between_processes",
}


def optional_arguments() -> set[str]:
    """``method.argument`` for every argument with a default (and every ``**kwargs``) of the constructor and of
    the public methods. The objects a method acts on (``prepare(*args)``, ``gather(tensor)``...) are not options."""
    found = set()
    for name, member in inspect.getmembers(Accelerator, callable):
        if name.startswith("_") and name != "__init__" or not inspect.isfunction(member):
            continue
        for parameter in inspect.signature(member).parameters.values():
            if parameter.kind is parameter.VAR_KEYWORD or parameter.default is not parameter.empty:
                found.add(f"{name}.{parameter.name}")
    return found


def test_every_argument_has_a_case():
    arguments = optional_arguments()
    assert {"__init__.downcast_bf16", "prepare_model.evaluation_mode", "log.log_kwargs"} <= arguments  # the reader works
    missing = sorted(arguments - set(CASES) - set(ON_SEVERAL_PROCESSES))
    assert not missing, f"Accelerator arguments without a case here: {missing}"
    assert not (set(CASES) | set(ON_SEVERAL_PROCESSES)) - arguments  # no case for an argument that is gone
    for where in ON_SEVERAL_PROCESSES.values():
        file, function = where.split("::")
        defined = {n.name for n in ast.walk(ast.parse((TESTS / file).read_text())) if isinstance(n, ast.FunctionDef)}
        assert function in defined, where


@pytest.mark.parametrize("argument", sorted(set(CASES.values()), key=lambda case: case.__name__),
                         ids=lambda case: case.__name__)
def test_an_argument_has_an_effect_or_is_refused_in_one_sentence(argument: Callable[[Path], None], tmp_path: Path):
    argument(tmp_path)

