"""debug=fast_dev_run | overfit | profile (small YAMLs over the defaults) and Accelerator.profile()."""

from __future__ import annotations

import json

import torch

from app.distributed import Accelerator
from app.distributed.profiling import ProfileKwargs
from app.engine.run import run
from tests.conftest import compose_config

QUIET = ("logging.progress_bar=false", "logging.print_config=false")


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fast_dev_run_takes_two_steps_two_eval_batches_and_leaves_no_checkpoint(tmp_path):
    run(compose_config("debug=fast_dev_run", *QUIET), tmp_path)
    logged = events(tmp_path)
    assert [e["step"] for e in logged if "train/loss" in e] == [1, 2]
    assert [e["eval/num_samples"] for e in logged if "eval/loss" in e] == [64]  # 2 batches of 32
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "model").exists()
    assert not (tmp_path / "tensorboard").exists()


def test_overfit_learns_its_few_batches_by_heart(tmp_path):
    run(compose_config("debug=overfit", "trainer.max_epochs=60", *QUIET), tmp_path)
    evaluations = [e for e in events(tmp_path) if "eval/accuracy" in e]
    assert all(e["eval/num_samples"] == 64 for e in evaluations)
    assert evaluations[0]["eval/accuracy"] < 0.9 and evaluations[-1]["eval/accuracy"] == 1.0


def test_profile_writes_a_chrome_trace_of_the_real_loop_into_the_run_folder(tmp_path):
    run(compose_config("debug=profile", *QUIET), tmp_path)
    trace = json.loads((tmp_path / "profile" / "profile_0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    # Steps count from 0: one waited, one warm-up, three recorded.
    assert {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"} <= names and "ProfilerStep#1" not in names
    assert any(n.startswith("aten::") and "mm" in n for n in names)  # the model's matrix products


def test_accelerator_profile_as_accelerate_documents_it(tmp_path):
    acc = Accelerator(cpu=True, kwargs_handlers=[ProfileKwargs(activities=["cpu"], record_shapes=True,
                                                               output_trace_dir=str(tmp_path))])
    x = torch.randn(16, 16)
    with acc.profile() as prof:
        (x @ x).sum()
    assert "aten::mm" in prof.key_averages().table()
    assert any(e.get("name") == "aten::mm" for e in json.loads((tmp_path / "profile_0.json").read_text())["traceEvents"])
