"""python -m app mode=eval resume=<model folder | run folder>: the saved weights' metrics on the evaluation
set, on 1 and 2 processes, with nothing of the trained run touched."""

from __future__ import annotations

import json

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
