"""python -m app mode=eval resume=<model folder | run folder>: the saved weights' metrics on the evaluation
set, on 1 and 2 processes, with nothing of the trained run touched."""

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
