"""``task.sample_prompts`` (issue 38): at each evaluation during training, the first N evaluation prompts
completed greedily (``task.max_new_tokens``) are written to ``<run>/samples/step_<N>.jsonl`` (prompt,
completion, the answer trained towards) and to TensorBoard as text; on two processes (DDP, gloo) the
main process generates alone and the run goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.engine.run import run as run_in_process
from tests.conftest import compose_config, launch_app
from tests.test_sft_engine import QUIET, chat  # noqa: F401 - the fixture

ARGS = ("task.sample_prompts=2", "task.max_new_tokens=6", "task.packing=true", "task.block_size=128",
        "trainer.batch_size=2", "trainer.max_steps=4", "trainer.eval_every_n_steps=2",
        "early_stopping.patience=null")


def assert_samples(run: Path, steps: tuple[int, ...]) -> None:
    files = sorted((run / "samples").iterdir())
    assert [f.name for f in files] == [f"step_{s}.jsonl" for s in steps]
    for file in files:
        rows = [json.loads(line) for line in file.read_text().splitlines()]
        assert len(rows) == 2
        for row in rows:
            assert set(row) == {"prompt", "completion", "reference"}
            assert row["prompt"].endswith("<|im_start|>assistant\n")  # the conversation up to its first answer
            assert row["reference"].endswith("<|im_end|>") and isinstance(row["completion"], str)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_evaluation_writes_its_samples_to_the_run_folder_and_tensorboard(tmp_path, chat):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    run.mkdir()
    cfg = compose_config(*chat, *QUIET, *ARGS, "logging.trackers=[tensorboard]")
    run_in_process(cfg, run)
    assert_samples(run, (2, 4))
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = [t for t in events.Tags()["tensors"] if "samples" in t]
    assert texts, events.Tags()
    steps = sorted(e.step for e in events.Tensors(texts[0]))
    assert steps == [2, 4]
    table = events.Tensors(texts[0])[0].tensor_proto.string_val[0].decode()
    assert table.startswith("| prompt | completion | reference |")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_on_two_processes_the_main_process_writes_the_samples(tmp_path, chat):  # noqa: F811
    run = tmp_path / "run2"
    launch_app(*chat, *QUIET, *ARGS, "hardware=multi_cpu", run_dir=run)
    assert_samples(run, (2, 4))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_with_fsdp2_every_process_generates_and_the_main_one_writes(tmp_path, chat):  # noqa: F811
    run = tmp_path / "fsdp"
    launch_app(*chat, *QUIET, *ARGS, "hardware=fsdp", run_dir=run)
    assert_samples(run, (2, 4))
