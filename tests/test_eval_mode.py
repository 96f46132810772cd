"""python -m app mode=eval resume=<model folder | run folder>: the saved weights' metrics on the evaluation
set, on 1 and 2 processes, with nothing of the trained run touched; with ``task.predict_test=true``, its
test split's predictions too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.engine.run import run
from tests.conftest import compose_config, run_app


def snapshot(folder):
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.rglob("*"))}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_eval_mode_measures_the_saved_weights_and_touches_nothing(tmp_path):
    trained = tmp_path / "trained"
    run(compose_config("trainer.max_epochs=-1", "trainer.max_steps=30", "checkpoint.export=last",
                       "logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false"), trained)
    final = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()][-1]
    before = snapshot(trained)

    for source, extra in ((trained / "model", ()), (trained, ("hardware=multi_cpu", "hardware.num_processes=2"))):
        out = tmp_path / f"eval-{len(extra)}"
        proc = run_app("mode=eval", f"resume={source}", f"hydra.run.dir={out}", *extra, cwd=tmp_path, timeout=200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        measured = json.loads((out / "eval_metrics.json").read_text())["metrics"]
        assert measured["eval/accuracy"] == final["eval/accuracy"]
        assert measured["eval/num_samples"] == final["eval/num_samples"] == 360
        assert measured["eval/loss"] == pytest.approx(final["eval/loss"], rel=1e-5)
        assert not (out / "checkpoints").exists() and not (out / "model").exists()
    assert snapshot(trained) == before


@pytest.mark.timeout(300)
def test_eval_mode_with_predict_test_writes_one_prediction_per_test_row(tmp_path, text_model):
    from tests.helpers.text_data import pair_rows, write_csv

    header = ["question", "answer", "label"]
    write_csv(tmp_path / "train.csv", header, pair_rows(200, 1))
    write_csv(tmp_path / "validation.csv", header, pair_rows(40, 2))
    write_csv(tmp_path / "test.csv", header[:2], [row[:2] for row in pair_rows(23, 3)])
    data = ("task=text_classification", "task.data_files.train=train.csv", "task.data_files.validation=validation.csv",
            "task.data_files.test=test.csv", "task.text_fields=[question,answer]", f"task.model={text_model}")
    quiet = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")
    # Trained without predictions (docs/tasks.md's first command), then asked for them in mode=eval.
    run_app(*data, "trainer.max_steps=10", "optim.lr=3e-3", "hydra.run.dir=trained", *quiet, cwd=tmp_path,
            check=True, timeout=200)
    assert not (tmp_path / "trained" / "test_predictions.tsv").exists()
    proc = run_app("mode=eval", "resume=trained", "task.predict_test=true", "hydra.run.dir=evaluated", *quiet,
                   cwd=tmp_path, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "evaluated" / "test_predictions.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 1 + 23
    assert [line.split("\t")[0] for line in lines[1:]] == [str(i) for i in range(23)]
    assert {line.split("\t")[1] for line in lines[1:]} <= {"yes", "no"}
    # The same weights a training run with task.predict_test=true predicts with (its export: the best).
    run_app(*data, "trainer.max_steps=10", "optim.lr=3e-3", "task.predict_test=true", "hydra.run.dir=predicted",
            *quiet, cwd=tmp_path, check=True, timeout=200)
    assert (tmp_path / "predicted" / "test_predictions.tsv").read_text().splitlines() == lines


def test_eval_mode_without_weights_is_one_sentence(tmp_path):
    proc = run_app("mode=eval", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "mode=eval needs the weights to evaluate" in proc.stderr


@pytest.mark.timeout(300)
def test_eval_mode_reads_an_fsdp_checkpoint_and_a_sharded_export_on_one_process(tmp_path):
    import shutil

    from safetensors.torch import load_file

    from app.distributed.checkpoint.export import write_weights

    fixture = Path(__file__).parent / "fixtures" / "checkpoints_9b0b569" / "fsdp"
    trained = tmp_path / "trained"
    shutil.copytree(fixture, trained)
    expected = json.loads((trained / "model" / "export.json").read_text())["metric"]["value"]
    # The exported weights again, as two shards and model.safetensors.index.json (save_model's layout
    # for a large model, and transformers').
    weights = load_file(trained / "model" / "model.safetensors")
    names = sorted(weights)
    sharded = trained / "sharded"
    sharded.mkdir()
    write_weights(sharded, [{k: weights[k] for k in names[:2]}, {k: weights[k] for k in names[2:]}], safe=True,
                  each_file_atomic=False)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    before = snapshot(trained)

    # FSDP2's per-rank weight shards in a checkpoint, and the sharded export, each on one process
    # (hardware=cpu leaves the trained run's hardware.num_processes=2 behind).
    for source in (trained / "checkpoints" / "checkpoint_1", sharded):
        out = tmp_path / f"eval-{source.name}"
        proc = run_app("mode=eval", f"resume={source}", "hardware=cpu", f"hydra.run.dir={out}", cwd=tmp_path,
                       timeout=200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        measured = json.loads((out / "eval_metrics.json").read_text())["metrics"]
        assert measured["eval/accuracy"] == pytest.approx(expected, abs=1e-7), source
    assert snapshot(trained) == before
