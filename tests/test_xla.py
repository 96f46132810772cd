"""``hardware=tpu`` on PyTorch/XLA, run on XLA's CPU device (``PJRT_DEVICE=CPU CPU_NUM_DEVICES=2``:
two devices for SPMD). .ci/run runs these in .venv-xla (torch 2.9.0 + torch_xla 2.9.0) with
``-m xla``; in an environment without torch_xla they skip with the reason, except the test of
what happens without it.

XLA:CPU compiles slowly, so the runs are short; in-process runs share one XLA runtime (and its
compiled-graph cache), the runs that need another device count or a SIGKILL are subprocesses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.config import ConfigError
from app.distributed.checkpoint.store import FAULT_ENV, complete_checkpoints
from app.distributed.hardware.xla import bf16_variable_refusal, tpu_attached, xla_problem
from app.engine.loop import NoCheckpoints
from app.launching.validate import validate
from tests.conftest import SHARED_DATA, compose_config, run_app
from tests.helpers.metrics_rows import metrics_rows, without_throughput

pytestmark = pytest.mark.xla

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
needs_xla = pytest.mark.skipif(
    xla_problem() is not None,
    reason=f"{xla_problem()} (.ci/run runs these in .venv-xla with PJRT_DEVICE=CPU CPU_NUM_DEVICES=2)")
QUIET = ("logging.progress_bar=false", "logging.trackers=[]", "early_stopping.patience=null")


@pytest.fixture(autouse=True, scope="module")
def _compile_cache_in_a_temporary_folder(tmp_path_factory):
    """hardware.compile_cache_dir's default is the user's cache folder: here a temporary one, for the
    in-process runs and the subprocesses alike."""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved


events = metrics_rows


def compiled_graphs() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def host_reads() -> int:
    """Device values read by the host (``.item()`` and the like): each one is a sync point."""
    import torch_xla.debug.metrics as met

    return int(met.counter_value("aten::_local_scalar_dense") or 0)


def xla_report(run_dir: Path) -> str:
    """The run's closing XLA line (app.log): graphs compiled, cache loads, executions, fallbacks."""
    lines = [line for line in (run_dir / "app.log").read_text().splitlines() if "] - XLA: " in line]
    assert len(lines) == 1, lines
    return lines[0].split("] - ", 1)[1]


def report_count(report: str, pattern: str) -> int:
    import re

    found = re.search(pattern, report)
    return int(found.group(1)) if found else 0


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


# -- refusals: one sentence, exit 2 -------------------------------------------------------------------


@pytest.mark.skipif(HAS_TORCH_XLA, reason="torch_xla is installed here")
@pytest.mark.timeout(120)
def test_without_torch_xla_hardware_tpu_exits_2_saying_how_to_install_it(tmp_path):
    proc = run_app("hardware=tpu", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # Installing it into this environment would replace its torch: the sentence says to make another.
    assert last_line(proc).startswith("error: hardware=tpu needs PyTorch/XLA")
    assert "separate environment" in last_line(proc) and "python3 -m venv .venv-xla" in last_line(proc)
    assert "torch==2.9.0 torch_xla==2.9.0" in last_line(proc)


def test_fp16_on_tpu_is_refused_in_one_sentence_installed_or_not():
    with pytest.raises(ConfigError, match=r"^precision=fp16 does not run on hardware=tpu.*precision=bf16") as err:
        validate(compose_config("hardware=tpu", "precision=fp16"))
    assert "\n" not in str(err.value)


@pytest.mark.timeout(120)
def test_xla_bf16_variables_are_refused_in_one_sentence_and_nothing_is_written(tmp_path, monkeypatch):
    """bf16 is autocast only: XLA_USE_BF16 / XLA_DOWNCAST_BF16 would store the weights and the
    optimizer state in bf16 too. Refused whether or not torch_xla is installed here."""
    proc = run_app("hardware=tpu", "precision=bf16", cwd=tmp_path, env={"XLA_USE_BF16": "1", "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last_line(proc).startswith("error: XLA_USE_BF16 is set, which makes torch_xla keep every float tensor")
    assert "unset it and use precision=bf16" in last_line(proc)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "outputs").exists()
    monkeypatch.setenv("XLA_USE_BF16", "0")  # switched off: nothing to refuse
    assert bf16_variable_refusal() is None
    monkeypatch.setenv("XLA_DOWNCAST_BF16", "true")  # the other one, refused alike
    with pytest.raises(ConfigError, match="^XLA_DOWNCAST_BF16 is set, which makes torch_xla keep every float tensor"):
        validate(compose_config("hardware=tpu"))
    with pytest.raises(ConfigError, match=r"^hardware.sharding=fsdp shards over the devices of the SPMD mesh and needs hardware=tpu"):
        validate(compose_config("hardware=cpu", "hardware.sharding=fsdp"))


@pytest.mark.skipif(not HAS_TORCH_XLA or tpu_attached(), reason="needs torch_xla on a machine without a TPU")
@pytest.mark.timeout(120)
def test_with_torch_xla_but_no_tpu_and_no_pjrt_device_it_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    proc = subprocess.run([sys.executable, "-m", "app", "hardware=tpu", f"hydra.run.dir={tmp_path / 'run'}"],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "found no TPU" in last_line(proc) and "PJRT_DEVICE=CPU" in last_line(proc)


# -- training on XLA ----------------------------------------------------------------------------------


class Recorder(NoCheckpoints):
    """A checkpoint hook that writes nothing: it notes, at every evaluation, the graphs compiled and
    the host reads so far, and after every optimizer step the graphs executed so far (the other hooks
    stay NoCheckpoints' no-ops)."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[int, int, dict[str, float]]] = {}
        self.executions: dict[int, int] = {}

    def on_step_end(self, state, metrics) -> None:
        import torch_xla.core.xla_model as xm

        from app.distributed.backends.xla_metrics import XlaCounts

        xm.wait_device_ops()  # the executions launched so far have run (they are counted as they run)
        self.executions[state.global_step] = XlaCounts.now().executions
        if metrics is not None:
            self.at[state.global_step] = (compiled_graphs(), host_reads(), metrics)


@needs_xla
@pytest.mark.timeout(300)
def test_spmd_bf16_digits_compiles_nothing_new_after_warm_up_and_reads_the_host_only_at_log_points(tmp_path):
    from app.distributed.random import set_seed
    from app.engine.build import build_accelerator, build_components, build_early_stopping
    from app.engine.loop import LoopState, fit

    cfg = compose_config("hardware=tpu", "precision=bf16", "trainer.max_steps=40", "trainer.eval_every_n_steps=10",
                         "trainer.log_every_n_steps=5", *QUIET)
    set_seed(cfg.seed)
    acc = build_accelerator(cfg, tmp_path)
    assert acc.distributed_type == "XLA" and acc.num_processes == 1 and acc.static_shapes
    assert acc.backend.num_devices == 2 and acc.mixed_precision == "bf16"
    components = build_components(cfg, acc)
    x, _ = next(iter(components.train_loader))
    import torch_xla

    from app.distributed.backends.xla_metrics import XlaCounts

    assert "devices=[2" in torch_xla._XLAC._get_xla_sharding_spec(x)  # the batch is split over both devices
    # Loaded and placed two batches ahead by a background thread.
    assert components.train_loader.prefetch == 2
    start = XlaCounts.now()
    recorder = Recorder()
    fit(components, cfg, LoopState(), build_early_stopping(cfg), recorder)

    assert sorted(recorder.at) == [10, 20, 30, 40]
    graphs = {step: g for step, (g, _, _) in recorder.at.items()}
    # Warm-up compiles: the first steps, the first log point, the first evaluation and the first step
    # after it (about a dozen graphs); then 20 more steps with 2 more evaluations compile nothing.
    assert graphs[40] == graphs[20] and graphs[20] - graphs[10] <= 1 and graphs[10] <= 15, graphs
    reads = recorder.at[40][1] - recorder.at[10][1]
    assert reads < 30, f"{reads} host reads in 30 steps: something reads the device every step"
    # A log step (15, 25, 35) reads its loss a step later, from the step's own graph: no graph of its
    # own, so one execution per step (reading it at once ran one more at each log step).
    ran = recorder.executions
    assert [ran[s] - ran[s - 1] for s in range(12, 20)] == [1] * 8, ran
    assert [ran[s] - ran[s - 1] for s in range(32, 40)] == [1] * 8, ran
    assert acc.reads_lag
    # Evaluation batches are padded to full size; gather_for_metrics drops the padding.
    assert all(m["eval/num_samples"] == 360 for _, _, m in recorder.at.values())
    assert recorder.at[40][2]["eval/accuracy"] > 0.5
    # Nothing ran on the host for want of an XLA lowering, and the run's report says so.
    assert XlaCounts.now().since(start).fallbacks == {}
    assert acc.runtime_report().endswith("CPU fallback ops: none")


@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_devices_follow_one_device_with_the_same_global_batch(tmp_path):
    """SPMD splits each batch of 32 over the devices; the result is the one-device run's."""
    args = ("hardware=tpu", "trainer.max_steps=20", "trainer.log_every_n_steps=2", "trainer.eval_every_n_steps=20",
            "checkpoint.every_epoch=false", "checkpoint.save_final_model=false", "logging.progress_bar=false",
            "logging.trackers=[]")
    losses = {}
    for devices in ("1", "2"):
        run_dir = tmp_path / devices
        run_app(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path, env={"CPU_NUM_DEVICES": devices}, check=True)
        losses[devices] = [e["train/loss"] for e in events(run_dir) if "train/loss" in e]
    assert len(losses["1"]) == 10
    assert losses["1"] == pytest.approx(losses["2"], abs=1e-4), losses


@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_xla_checkpoint_resumes_on_cpu_and_a_cpu_checkpoint_on_xla(tmp_path):
    """One checkpoint format: what one hardware kind saved, the other continues (the optimizer's own
    step count included). Separate processes, as a user would run them."""
    from app.distributed.checkpoint.store import read_state

    base = ("trainer.max_epochs=3", "trainer.eval_every_n_steps=15", "checkpoint.every_epoch=false",
            "checkpoint.every_n_steps=15", *QUIET)
    for first, then in (("tpu", "cpu"), ("cpu", "tpu")):
        run_dir = tmp_path / f"{first}-then-{then}"
        run_app(f"hardware={first}", "trainer.max_steps=15", *base, f"hydra.run.dir={run_dir}", cwd=tmp_path,
                check=True)
        run_app(f"resume={run_dir}", f"hardware={then}", "trainer.max_steps=30", cwd=tmp_path, check=True)
        evals = [e for e in events(run_dir) if "eval/accuracy" in e]
        assert [e["step"] for e in evals] == [15, 30] and evals[1]["eval/num_samples"] == 360
        assert evals[1]["eval/accuracy"] > evals[0]["eval/accuracy"]
        newest, manifest = complete_checkpoints(run_dir / "checkpoints")[-1]
        optimizer = read_state(newest, "optimizer")
        assert manifest.step == 30 and {float(s["step"]) for s in optimizer["state"].values()} == {30.0}


@pytest.mark.signals
@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_on_xla_and_resumed_ends_bitwise_identical(tmp_path):
    """Also the persistent compile cache: the resumed run finds in it the graphs the reference run
    compiled (the same steps, evaluations and saves give the same graphs)."""
    args = ("hardware=tpu", "trainer.max_steps=30", "checkpoint.every_n_steps=10", "checkpoint.every_epoch=false",
            "trainer.log_every_n_steps=5", "trainer.eval_every_n_steps=15", "logging.progress_bar=false",
            "logging.trackers=[]", "early_stopping.patience=null", f"hardware.compile_cache_dir={tmp_path / 'xla'}")
    reference, run = tmp_path / "reference", tmp_path / "run"
    run_app(*args, f"hydra.run.dir={reference}", cwd=tmp_path, check=True)
    # SIGKILL with the second checkpoint (step 20) half written: the run resumes from step 10.
    proc = run_app(*args, f"hydra.run.dir={run}", cwd=tmp_path, env={FAULT_ENV: "files:1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [m.step for _, m in complete_checkpoints(run / "checkpoints")] == [10]
    run_app(f"resume={run}", cwd=tmp_path, check=True)

    assert (run / "model" / "model.safetensors").read_bytes() == \
        (reference / "model" / "model.safetensors").read_bytes()

    def logged(run_dir: Path) -> list[tuple]:
        return without_throughput(events(run_dir))

    assert logged(run) == logged(reference)

    first, resumed = xla_report(reference), xla_report(run)
    assert first.endswith("CPU fallback ops: none") and resumed.endswith("CPU fallback ops: none"), (first, resumed)
    compiled = report_count(resumed, r"(\d+) graph\(s\) compiled")
    in_cache = report_count(resumed, r"(\d+) loaded from") + report_count(resumed, r"\((\d+) found there")
    assert report_count(first, r"(\d+) graph\(s\) compiled") >= 8 and len(list((tmp_path / "xla").iterdir())) >= 8
    # At most one graph of the resumed run was new to the cache (torch_xla 2.9 then still compiles the
    # ones it found: it cannot load executables on XLA:CPU, the report says how many).
    assert compiled - in_cache <= 1, resumed


@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_glue_mrpc_on_xla_in_bf16_pads_to_fixed_shapes_and_gathers_every_validation_pair(tmp_path):
    from tests.helpers.tiny_bert import make_tiny_bert, make_tiny_glue_tsv, synthetic_pairs

    real = SHARED_DATA / "glue_mrpc"
    if real.is_dir():
        data_dir, expected = real, 408  # 12 full batches of 32 and one of 24, padded to 32
        rows = (real / "train.tsv").read_text(encoding="utf-8").splitlines()[1:601]
        sentences = [s for row in rows for s in row.split("\t")[3:5]]
    else:
        data_dir, expected = make_tiny_glue_tsv(tmp_path / "data", n_train=64, n_val=21), 21
        sentences = [s for _, a, b in synthetic_pairs(200, seed=3) for s in (a, b)]
    model = make_tiny_bert(tmp_path / "tiny_bert", sentences)
    run_dir = tmp_path / "run"
    run_app(f"hydra.run.dir={run_dir}", "task=glue_mrpc", "hardware=tpu", "precision=bf16",
            f"task.data_dir={data_dir}", f"task.model={model}", f"task.cache_dir={tmp_path / 'cache'}",
            "task.max_length=32", "trainer.max_steps=4", "trainer.eval_every_n_steps=2", "trainer.batch_size=8",
            "trainer.eval_batch_size=32", "logging.trackers=[]", "logging.progress_bar=false",
            # Asked for, Hub kernels stay off on XLA (transformers 5.25+ would kernelize at model.train(),
            # which the kernels library refuses for an 'xla' device), and the log says so.
            env={"USE_HUB_KERNELS": "YES"}, cwd=tmp_path, check=True, timeout=480)
    assert "USE_HUB_KERNELS=YES ignored: Hub kernels do not run on hardware=tpu's devices" in (run_dir / "app.log").read_text()
    evals = [e for e in events(run_dir) if "eval/f1" in e]
    assert [e["step"] for e in evals] == [2, 4] and all(e["eval/num_samples"] == expected for e in evals)
    assert xla_report(run_dir).endswith("CPU fallback ops: none"), xla_report(run_dir)

    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    assert loaded.config.num_labels == 2


@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_sharding_on_four_devices_trains_as_replicated_and_their_checkpoints_are_interchangeable(tmp_path):
    """hardware.sharding=fsdp (FSDPv2 through mark_sharding): every weight and its AdamW state split
    over the 4 devices, the losses of the replicated layout, and a checkpoint of either layout
    continued by the other as by itself. One process (tests/helpers/xla_sharding_run.py) trains both."""
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.xla_sharding_run", str(tmp_path)], cwd=Path(__file__).parents[1],
                          env={**os.environ, "CPU_NUM_DEVICES": "4"}, capture_output=True, text=True, timeout=380,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["specs"] == {"replicated": ["{replicated}"] * 2, "fsdp": ["{devices=[4,1]0,1,2,3}"] * 2}
    assert result["after_load"]["weight"] == "{devices=[4,1]0,1,2,3}"  # loading keeps the layout
    losses = result["losses"]
    assert len(losses["fsdp"]) == 6 and losses["fsdp"] == pytest.approx(losses["replicated"], abs=1e-5)
    assert losses["fsdp"][-1] != losses["fsdp"][0]  # it trained
    for layout in ("fsdp", "replicated"):
        assert result["crossed"][layout] == pytest.approx(result["straight"][layout], abs=1e-5)


@needs_xla
@pytest.mark.timeout(300)
def test_notebook_launcher_runs_spmd_in_this_process_with_a_model_built_outside():
    from app.distributed import Accelerator, notebook_launcher

    def train(model: torch.nn.Module) -> tuple[int, str, int, float]:
        accelerator = Accelerator()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            loss = (model(accelerator.backend.place_batch(x)) - 1).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return os.getpid(), accelerator.distributed_type, accelerator.num_processes, loss.item()

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    # Asked for 2 processes as on Accelerate's TPU path: SPMD drives both devices from this process.
    (result,) = notebook_launcher(train, args=(model,), num_processes=2, mixed_precision="bf16")
    assert result[:3] == (os.getpid(), "XLA", 1) and result[3] == result[3]  # a finite loss


# -- fixed shapes, without XLA: what the static_shapes backend property does to the data path --------


def test_static_shapes_pad_every_last_batch_and_gather_for_metrics_drops_the_padding():
    from torch.utils.data import DataLoader, TensorDataset

    from app.distributed import Accelerator, Backend

    class FixedShapeCpuBackend(Backend):
        static_shapes = True

    acc = Accelerator(backend=FixedShapeCpuBackend(torch.device("cpu")), seed=0)
    data = TensorDataset(torch.arange(408))
    eval_loader = acc.prepare(DataLoader(data, batch_size=32))
    sizes, gathered = [], []
    for (batch,) in eval_loader:
        sizes.append(len(batch))
        gathered.append(acc.gather_for_metrics(batch))
    assert sizes == [32] * 13  # 12 full batches and 24 samples padded to 32 from the epoch's start
    assert torch.equal(torch.cat(gathered), torch.arange(408))
    train_loader = acc.prepare(DataLoader(data, batch_size=32, shuffle=True))
    assert {len(batch) for (batch,) in train_loader} == {32} and len(train_loader) == 13


@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_packed_causal_lm_compiles_nothing_new_after_its_first_epochs(tmp_path):
    """task=causal_lm with packing has one block shape: after warm-up, epochs 3 and 4 (training,
    token counting, summed evaluation) compile no graph that epochs 1 and 2 did not."""
    from app.distributed.random import set_seed
    from app.engine.build import build_accelerator, build_components, build_early_stopping
    from app.engine.loop import LoopState, fit
    from tests.helpers.tiny_llama import documents, make_tiny_llama, write_text

    llama = make_tiny_llama(tmp_path / "llama", hidden=16, layers=1, heads=2, kv_heads=1)
    write_text(tmp_path / "train.txt", documents(16, seed=0))
    write_text(tmp_path / "validation.txt", documents(6, seed=1))
    cfg = compose_config("hardware=tpu", "task=causal_lm", f"task.config={llama}",
                         f"task.data_files.train={tmp_path / 'train.txt'}",
                         f"task.data_files.validation={tmp_path / 'validation.txt'}", "task.block_size=16",
                         f"task.cache_dir={tmp_path / 'cache'}", "trainer.batch_size=4", "trainer.max_epochs=4",
                         "trainer.log_every_n_steps=3", "optim.lr=1e-2", *QUIET)
    set_seed(cfg.seed)
    acc = build_accelerator(cfg, tmp_path)
    components = build_components(cfg, acc)
    steps = len(components.train_loader)
    cfg.trainer.eval_every_n_steps = steps  # a record at every epoch's end
    recorder = Recorder()
    fit(components, cfg, LoopState(), build_early_stopping(cfg), recorder)
    graphs = {step // steps: g for step, (g, _, _) in recorder.at.items()}
    assert sorted(graphs) == [1, 2, 3, 4] and graphs[4] == graphs[2], graphs
    losses = [m["eval/loss"] for _, _, m in recorder.at.values()]
    assert losses[-1] < losses[0]


@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_headline_command_exports_its_best_evaluation_and_its_terminal_shows_our_lines_only(tmp_path):
    """``python -m app task=glue_mrpc hardware=tpu precision=bf16 … trainer.max_steps=30
    trainer.eval_every_n_steps=15`` in a terminal (issue 41): the best evaluation (step 15, between the
    epoch's checkpoints) is what ``model/`` holds, byte for byte the export of the same run with a
    checkpoint at step 15 (which holds that evaluation's weights; a run stopped at 15 is no reference
    on XLA: its last step is another graph, and XLA may fuse it otherwise); and the terminal shows our
    lines only: torch_xla's C++ notices (GSPMD's deprecation at every compile, the compile cache's
    "Failed to deserialize executable", which the cache the first run filled makes appear) are in
    app.log instead."""
    import re

    from tests.helpers.tiny_bert import make_tiny_bert, make_tiny_glue_tsv, synthetic_pairs
    from tests.helpers.tmux import Terminal, app_command

    real = SHARED_DATA / "glue_mrpc"
    if real.is_dir():
        data_dir = real
        rows = (real / "train.tsv").read_text(encoding="utf-8").splitlines()[1:601]
        sentences = [s for row in rows for s in row.split("\t")[3:5]]
    else:
        data_dir = make_tiny_glue_tsv(tmp_path / "data", n_train=64, n_val=21)
        sentences = [s for _, a, b in synthetic_pairs(200, seed=3) for s in (a, b)]
    model = make_tiny_bert(tmp_path / "tiny_bert", sentences)
    command = ("task=glue_mrpc", "hardware=tpu", "precision=bf16", f"task.data_dir={data_dir}", f"task.model={model}",
               f"task.cache_dir={tmp_path / 'cache'}", "task.max_length=32", "trainer.batch_size=8",
               "trainer.eval_batch_size=32", "logging.trackers=[]", f"hardware.compile_cache_dir={tmp_path / 'xla'}",
               # The steps decide the end (the tiny files' epochs are 8 steps). The tiny model predicts one class
               # all along, so the evaluations tie on eval/f1 and the first to reach it (step 15) is the best.
               "trainer.max_epochs=-1", "trainer.max_steps=30", "trainer.eval_every_n_steps=15")
    run_app(*command, "checkpoint.every_n_steps=15", "logging.progress_bar=false",
            f"hydra.run.dir={tmp_path / 'at_best'}", cwd=tmp_path, check=True, timeout=400)
    # The export comes from the checkpoint of step 15 (its number depends on the data's epoch length).
    at_best = json.loads((tmp_path / "at_best" / "model" / "export.json").read_text())
    steps = {folder.name: manifest.step for folder, manifest in complete_checkpoints(tmp_path / "at_best" / "checkpoints")}
    assert (at_best["step"], steps[at_best["checkpoint"]]) == (15, 15), (at_best, steps)
    env = f"PJRT_DEVICE={os.environ['PJRT_DEVICE']} CPU_NUM_DEVICES={os.environ.get('CPU_NUM_DEVICES', '2')} "
    with Terminal(tmp_path, env + app_command(*command, f"hydra.run.dir={tmp_path / 'run'}"), width=200) as term:
        screen = term.wait_for_exit(450)
    assert "EXIT=0" in screen, screen[-4000:]
    native = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] ", re.MULTILINE)  # TSL's log lines
    assert not native.search(screen) and "GSPMD" not in screen and "deserialize" not in screen, screen[-4000:]
    assert "Warning:" not in screen, screen[-4000:]  # nor a Python warning
    log = (tmp_path / "run" / "app.log").read_text()
    kept = [line for line in log.splitlines() if "][torch_xla][WARNING] - " in line]
    assert any("GSPMD sharding propagation" in line for line in kept), log[-3000:]
    assert any("Failed to deserialize executable" in line for line in kept), log[-3000:]
    described = json.loads((tmp_path / "run" / "model" / "export.json").read_text())
    assert (described["exported"], described["step"], described["final_step"], described["checkpoint"]) == \
        ("best", 15, 30, "best_15")
    assert "exporting the best evaluation: step 15, eval/f1 = " in screen
    assert (tmp_path / "run" / "model" / "model.safetensors").read_bytes() == \
        (tmp_path / "at_best" / "model" / "model.safetensors").read_bytes()


# -- task=sft and task=dpo on XLA ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory) -> Path:
    """A tiny ChatML Llama (one layer, 16 wide), conversations and preference pairs, all offline."""
    from tests.helpers.dpo_pairs import preference_rows
    from tests.helpers.tiny_chat import conversations, make_tiny_chat_llama, write_jsonl

    folder = tmp_path_factory.mktemp("chat")
    make_tiny_chat_llama(folder / "base", hidden=16, layers=1, heads=2, kv_heads=1)
    write_jsonl(folder / "chat.jsonl", [{"messages": c} for c in conversations(48)])
    write_jsonl(folder / "chat_val.jsonl", [{"messages": c} for c in conversations(12, seed=7)])
    write_jsonl(folder / "prefs.jsonl", preference_rows(32))
    write_jsonl(folder / "prefs_val.jsonl", preference_rows(8, seed=7))
    return folder


SAME_EPOCHS = ("scheduler=constant",)
"""With the log step at each epoch's last step (trainer.log_every_n_steps = the epoch's steps), epochs 2
and 3 run the same graphs. With the linear schedule a step near the run's end compiled one more graph
(probably a learning rate of exactly 0 or 1, which torch_xla makes a constant of the graph); with a log
step elsewhere in the epoch, the step after it (which reads its loss) compiled another graph where it was
also the epoch's last."""


def run_recorded(monkeypatch, *overrides: str, run_dir: Path) -> dict[int, tuple[int, int, dict[str, float]]]:
    """``python -m app`` in this process (train, evaluate, export), its checkpoint policy also noting, at
    every evaluation (within an epoch or at its end), the graphs compiled and the host reads so far."""
    import app.engine.run as engine_run
    from app.engine.checkpoint import CheckpointPolicy

    at: dict[int, tuple[int, int, dict[str, float]]] = {}

    class Recording(CheckpointPolicy):
        def on_step_end(self, state, metrics) -> None:
            super().on_step_end(state, metrics)
            self.note(state, metrics)

        def on_epoch_end(self, state, metrics) -> None:
            super().on_epoch_end(state, metrics)
            self.note(state, metrics)

        @staticmethod
        def note(state, metrics) -> None:
            if metrics is not None:
                at[state.global_step] = (compiled_graphs(), host_reads(), metrics)

    monkeypatch.setattr(engine_run, "CheckpointPolicy", Recording)
    engine_run.run(compose_config(*overrides, f"hydra.run.dir={run_dir}", "logging.print_config=false", *QUIET),
                   run_dir)
    return at


def cpu_evaluation(task, model) -> dict[str, float]:
    """The task's evaluation metrics of ``model`` on the host, float32, batches as the CPU pads them."""
    from tests.test_sft import OneProcess

    data = task.build_data(OneProcess())
    batch = data.collate_fn([data.eval[i] for i in range(len(data.eval))])
    with torch.no_grad():
        sums = task.evaluation_sums(model.eval(), batch)
    return task.metrics_from_sums({name: float(value.double().sum()) for name, value in sums.items()})


@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "one_per_row"])
def test_sft_in_bf16_compiles_nothing_new_in_its_third_epoch_and_exports_what_it_evaluated(chat_files, tmp_path,
                                                                                           monkeypatch, packing):
    """``python -m app task=sft hardware=tpu precision=bf16`` with and without packing: every batch has
    the block's shape (packed rows, and single conversations padded to task.block_size), so epoch 3
    compiles no graph that epochs 1 and 2 did not; the evaluation (padded batches, the padding dropped)
    is the export's on the host in float32, within bf16's error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.tasks.sft.config import SFTConfig
    from app.tasks.sft.task import SFTTask

    data = (f"task.config={chat_files / 'base'}", f"task.data_files.train={chat_files / 'chat.jsonl'}",
            f"task.data_files.validation={chat_files / 'chat_val.jsonl'}", "task.block_size=128",
            f"task.packing={str(packing).lower()}", f"task.cache_dir={chat_files / 'cache'}")
    run_dir = tmp_path / "run"
    per_epoch = 7 if packing else 6  # 26 packed rows by 4, 48 conversations by 8
    at = run_recorded(monkeypatch, "task=sft", "hardware=tpu", "precision=bf16", *data, "trainer.max_epochs=3",
                      f"trainer.batch_size={4 if packing else 8}", *SAME_EPOCHS, f"trainer.log_every_n_steps={per_epoch}",
                      "optim.lr=3e-3", run_dir=run_dir)
    steps = sorted(at)
    assert steps == [per_epoch, 2 * per_epoch, 3 * per_epoch]  # one evaluation per epoch
    graphs, reads = [g for g, _, _ in at.values()], [r for _, r, _ in at.values()]
    assert graphs[2] == graphs[1], graphs
    # Host reads: the evaluation's sums and the log step's loss, the same in epochs 2 and 3.
    assert reads[2] - reads[1] == reads[1] - reads[0] <= 20, reads
    metrics = [m for _, _, m in at.values()]
    assert metrics[2]["eval/loss"] < metrics[0]["eval/loss"]
    assert all(m["eval/num_samples"] == 12 for m in metrics)  # conversations, packed (in 7 rows) or not

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert AutoTokenizer.from_pretrained(run_dir / "model").chat_template
    cfg = SFTConfig(config=str(chat_files / "base"), block_size=128, packing=packing, cache_dir=str(chat_files / "cache"))
    cfg.data_files.train, cfg.data_files.validation = str(chat_files / "chat.jsonl"), str(chat_files / "chat_val.jsonl")
    on_host = cpu_evaluation(SFTTask(cfg), exported)
    assert on_host["loss"] == pytest.approx(metrics[2]["eval/loss"], rel=2e-2)
    assert on_host["token_accuracy"] == pytest.approx(metrics[2]["eval/token_accuracy"], abs=0.05)


@needs_xla
@pytest.mark.timeout(300)
def test_packed_conversations_on_xla_never_attend_to_each_other(chat_files):
    """On the XLA device, with the 4-D block-diagonal mask hardware=tpu uses: each packed conversation's
    summed loss is its loss alone in a padded row, within XLA:CPU's float32 error; an all-ones 2-D mask
    (conversations attending to each other) is far off, which this comparison sees."""
    import torch_xla

    from app.tasks.sft.attention import use_eager_attention
    from app.tasks.sft.packing import SFTCollator
    from tests.helpers.tiny_chat import make_tokenizer
    from tests.test_sft import packed_batch, per_conversation_losses, tiny_model

    device = torch_xla.device()
    model = tiny_model(chat_files / "base", "sdpa")
    use_eager_attention(model)  # as SFTTask.build_model does where shapes are fixed
    model.to(device)
    _, batch, rows, pad = packed_batch(make_tokenizer())
    packed = per_conversation_losses(model, batch, explicit_mask=True, device=device)
    alone = per_conversation_losses(model, SFTCollator(pad, 160)(rows), device=device)
    assert len(alone) == 9 and all(packed[k] == 0.0 for k in packed if k not in alone)  # each row's padding tail
    for key, loss in alone.items():
        assert packed[key] == pytest.approx(loss, abs=1e-4, rel=1e-5)
    contaminated = per_conversation_losses(model, {**batch, "attention_mask": torch.ones_like(batch["input_ids"])},
                                           device=device)
    assert max(abs(contaminated[k] - loss) for k, loss in alone.items()) > 1e-2


@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dpo_in_bf16_compiles_nothing_new_in_its_third_epoch_and_exports(chat_files, tmp_path, monkeypatch):
    """``python -m app task=dpo hardware=tpu precision=bf16``: chosen and rejected rows padded to
    task.block_size, the frozen reference copy on the device; epoch 3 compiles nothing new, the margins
    grow, and the evaluation is the export's on the host (float32) within bf16's error."""
    from transformers import AutoModelForCausalLM

    from app.tasks.dpo.config import DPOConfig
    from app.tasks.dpo.task import DPOTask

    data = (f"task.config={chat_files / 'base'}", f"task.data_files.train={chat_files / 'prefs.jsonl'}",
            f"task.data_files.validation={chat_files / 'prefs_val.jsonl'}", "task.block_size=128",
            f"task.cache_dir={chat_files / 'cache'}")
    run_dir = tmp_path / "run"
    at = run_recorded(monkeypatch, "task=dpo", "hardware=tpu", "precision=bf16", *data, "trainer.max_epochs=3",
                      "trainer.batch_size=8", *SAME_EPOCHS, "trainer.log_every_n_steps=4", "optim.lr=3e-3",
                      run_dir=run_dir)
    steps = sorted(at)
    assert steps == [4, 8, 12], steps  # 32 pairs by 8, one evaluation per epoch
    graphs, reads = [g for g, _, _ in at.values()], [r for _, r, _ in at.values()]
    assert graphs[2] == graphs[1], graphs
    # Host reads: the evaluation's sums and the log step's loss, the same in epochs 2 and 3.
    assert reads[2] - reads[1] == reads[1] - reads[0] <= 20, reads
    metrics = [m for _, _, m in at.values()]
    assert metrics[2]["eval/rewards/margins"] > metrics[0]["eval/rewards/margins"]
    assert all(m["eval/num_samples"] == 8 for m in metrics)

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    cfg = DPOConfig(config=str(chat_files / "base"), block_size=128, packing=False, cache_dir=str(chat_files / "cache"))
    cfg.data_files.train, cfg.data_files.validation = str(chat_files / "prefs.jsonl"), str(chat_files / "prefs_val.jsonl")
    from tests.test_dpo import OneProcess

    task = DPOTask(cfg)
    task.build_data(OneProcess())  # the runtime that prepares the reference copy
    task.build_model()  # the reference: the starting weights, as the run's
    on_host = cpu_evaluation(task, exported)
    assert on_host["logps/chosen"] == pytest.approx(metrics[2]["eval/logps/chosen"], rel=1e-2)
    assert on_host["rewards/margins"] == pytest.approx(metrics[2]["eval/rewards/margins"], abs=0.02)


@needs_xla
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_reward_model_in_bf16_compiles_nothing_new_in_its_third_epoch_and_exports(chat_files, tmp_path, monkeypatch):
    """``python -m app task=reward_model hardware=tpu precision=bf16``: both sides of each pair padded to
    task.block_size; epoch 3 compiles nothing new, and the export, loaded by Transformers alone and scored on
    the host in float32, ranks the evaluation pairs as the run measured (within bf16's error). That it learns
    is shown on the CPU (tests/test_reward_model_app.py): 12 steps of this toy set move the loss little."""
    from app.tasks.reward_model.scorer import RewardScorer
    from tests.helpers.dpo_pairs import preference_rows

    data = (f"task.config={chat_files / 'base'}", f"task.data_files.train={chat_files / 'prefs.jsonl'}",
            f"task.data_files.validation={chat_files / 'prefs_val.jsonl'}", "task.block_size=128",
            f"task.cache_dir={chat_files / 'cache'}")
    run_dir = tmp_path / "run"
    at = run_recorded(monkeypatch, "task=reward_model", "hardware=tpu", "precision=bf16", *data,
                      "trainer.max_epochs=3", "trainer.batch_size=8", *SAME_EPOCHS, "trainer.log_every_n_steps=4",
                      "optim.lr=3e-3", run_dir=run_dir)
    assert sorted(at) == [4, 8, 12], sorted(at)  # 32 pairs by 8, one evaluation per epoch
    graphs, reads = [g for g, _, _ in at.values()], [r for _, r, _ in at.values()]
    assert graphs[2] == graphs[1], graphs
    assert reads[2] - reads[1] == reads[1] - reads[0] <= 20, reads
    metrics = [m for _, _, m in at.values()]
    assert all(m["eval/num_samples"] == 8 for m in metrics)
    assert metrics[2]["eval/loss"] != metrics[0]["eval/loss"]  # trained

    rows = preference_rows(8, seed=7)  # prefs_val.jsonl's pairs
    scorer = RewardScorer(run_dir / "model")
    chosen = scorer.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = scorer.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    assert sum(m > 0 for m in margins) / 8 == metrics[2]["eval/accuracy"]
    assert sum(margins) / 8 == pytest.approx(metrics[2]["eval/margin"], abs=0.05 + 0.02 * abs(metrics[2]["eval/margin"]))


@needs_xla
@pytest.mark.timeout(300)
def test_the_chunked_loss_on_xla_has_the_plain_loss_gradients(chat_files):
    """task.loss_chunk on the XLA device (torch_xla's checkpoint recomputes each chunk in backward):
    per-position losses and every gradient those of the plain loss, within XLA:CPU's float32 error."""
    import torch_xla

    from app.tasks.causal_lm.task import token_losses
    from app.tasks.sft.attention import model_inputs, use_eager_attention
    from app.tasks.sft.chunked import losses_from_head
    from tests.helpers.tiny_chat import make_tokenizer
    from tests.test_sft import packed_batch, tiny_model

    device = torch_xla.device()
    model = tiny_model(chat_files / "base", "sdpa").train()
    use_eager_attention(model)
    model.to(device)
    _, batch, _, _ = packed_batch(make_tokenizer())
    batch = {key: value.to(device) for key, value in batch.items()}
    inputs = model_inputs(batch, True, torch.float32)

    def losses_and_gradients(chunk: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        if chunk:
            with losses_from_head(model, batch["labels"], chunk):
                losses = model(**inputs, use_cache=False).logits[..., 0]
        else:
            losses = token_losses(model(**inputs, use_cache=False).logits, batch["labels"])[0]
        losses.sum().backward()
        return losses.detach().cpu(), [p.grad.detach().cpu() for p in model.parameters()]

    plain, plain_grads = losses_and_gradients(0)
    chunked, chunked_grads = losses_and_gradients(48)  # rows of 160: four chunks, the last one short
    assert torch.allclose(chunked, plain, atol=1e-5)
    assert plain_grads[0].abs().sum() > 0
    for ours, theirs in zip(chunked_grads, plain_grads, strict=True):
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)
