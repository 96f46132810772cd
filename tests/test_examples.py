"""``examples/tabular``: a task from the user's own package and config folder, run through
``python -m app --config-dir conf task=tabular`` as docs/tasks.md shows, with no change to ``app/``: one
and two processes, an exact resume, ``mode=eval`` of the export, a sweep, and its config checked as
ours is (an unknown key, a wrong type, a value its own rule refuses, a typo). The commands run two at a
time where they do not depend on each other: each pays ~5 s of CPU to import torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")


@pytest.fixture
def example(tmp_path) -> Path:
    """A copy of examples/tabular (the package and its config folder), where a user would cd to."""
    return shutil.copytree(REPO / "examples" / "tabular", tmp_path / "tabular",
                           ignore=shutil.ignore_patterns("outputs", "multirun", "__pycache__"))


ONE_THREAD = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
"""Commands run two at a time on the test machine's two cores: one thread each (torch's default,
one per core, would have them spin against each other)."""


def start(example: Path, *args: str) -> subprocess.Popen:
    """``python -m app --config-dir conf <args>`` in the example's folder, as docs/tasks.md shows it."""
    return subprocess.Popen([sys.executable, "-m", "app", "--config-dir", "conf", *args, *QUIET], cwd=example,
                            env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(*procs: subprocess.Popen) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"python -m app {' '.join(map(str, proc.args[3:]))} failed:\n{err[-3000:]}"


def evaluations(run: Path) -> list[dict]:
    return [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/accuracy" in e]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_tabular_example_trains_resumes_evaluates_and_sweeps_from_its_own_folder(example, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from app.engine.run import run
    from tests.conftest import compose_many

    # A constant learning rate: the schedule is the same however many epochs a segment runs.
    finish(start(example, "task=tabular", "scheduler=constant", "trainer.max_epochs=2", "hydra.run.dir=split"),
           start(example, "task=tabular", "hardware=multi_cpu", "hardware.num_processes=2", "trainer.max_epochs=1",
                 "hydra.run.dir=two"))
    resume = start(example, "resume=split", "trainer.max_epochs=4")  # the run's own overrides (task=tabular) are reused
    sweep = start(example, "-m", "task=tabular", "task.hidden_sizes=[32],[16,16]", "trainer.max_epochs=1",
                  "hydra.sweep.dir=sweep")
    # Meanwhile, the run that goes through the 4 epochs at once, in this process (the same engine; a
    # third interpreter would only import torch again), one thread like the commands.
    monkeypatch.syspath_prepend(str(example))
    (through,) = compose_many([["task=tabular", "scheduler=constant", "trainer.max_epochs=4", *QUIET,
                                f"hydra.searchpath=[file://{example / 'conf'}]"]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (example / "through").mkdir()
        run(through, example / "through")
    finally:
        torch.set_num_threads(threads)
    finish(resume, sweep)
    evaluate = start(example, "mode=eval", "resume=split/model", "hydra.run.dir=evaluated")

    expected, resumed = evaluations(example / "through"), evaluations(example / "split")
    assert [e["step"] for e in expected] == [25, 50, 75, 100] and expected[-1]["eval/accuracy"] > 0.8
    assert resumed == expected  # bit for bit: losses, metrics, and the weights below
    weights = [load_file(example / folder / "model" / "model.safetensors") for folder in ("through", "split")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    newest = max((example / "split" / "checkpoints").glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[1]))
    saved = json.loads((newest / "custom_checkpoint_0.json").read_text())
    assert set(saved) == {"mean", "std"} and len(saved["mean"]) == 16  # the task's own checkpointed state
    assert json.loads((example / "split" / "model" / "tabular.json").read_text())["config"]["features"] == 16

    assert (example / "two" / "app.log").read_text().count("training tabular on 2 process(es);") == 1
    assert [e["eval/num_samples"] for e in evaluations(example / "two")] == [400]  # every row once, over 2 ranks
    results = [json.loads((example / "sweep" / job / "result.json").read_text()) for job in ("0", "1")]
    assert [r["status"] for r in results] == ["finished", "finished"]
    assert "**Best: job" in (example / "sweep" / "sweep.md").read_text()

    finish(evaluate)
    exported = json.loads((example / "split" / "model" / "export.json").read_text())
    measured = json.loads((example / "evaluated" / "eval_metrics.json").read_text())["metrics"]
    at_export = next(e for e in expected if e["step"] == exported["step"])
    assert measured["eval/accuracy"] == at_export["eval/accuracy"] and measured["eval/num_samples"] == 400


@pytest.mark.timeout(200)
def test_eval_and_resume_without_config_dir_use_the_runs_own_config_folder(example):
    finish(start(example, "task=tabular", "trainer.max_epochs=1", "hydra.run.dir=trained"))
    # --config-dir forgotten: the run folder's record (.hydra/hydra.yaml) says where task=tabular came from.
    plain = [sys.executable, "-m", "app", *QUIET]
    proc = subprocess.run([*plain, "mode=eval", "resume=trained", "hydra.run.dir=evaluated"], cwd=example,
                          env=ONE_THREAD, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads((example / "evaluated" / "eval_metrics.json").read_text())["metrics"]
    assert measured["eval/accuracy"] == evaluations(example / "trained")[-1]["eval/accuracy"]
    # The folder moved since: one sentence that says what to add, exit 2, nothing written.
    (example / "conf").rename(example / "my_conf")
    proc = subprocess.run([*plain, "resume=trained", "trainer.max_epochs=2"], cwd=example, env=ONE_THREAD,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: the run trained was composed with the config folder {example / 'conf'} (--config-dir), "
        "which is not there any more; add --config-dir <that folder's new place>.")
    assert evaluations(example / "trained")[-1]["step"] == 25


@pytest.mark.timeout(200)
def test_the_example_config_is_checked_as_ours_is(example, monkeypatch):
    """An unknown key (added with +), a value the schema's own rule refuses, a typo Hydra refuses as it
    does for our tasks: one sentence each; a wrong type, in this process (the same path as the first
    two, without paying torch's import once more)."""
    from app.config import ConfigError
    from app.tasks.external import typed_task_config

    cases = {
        "+task.hiden=3": "unknown configuration key task.hiden: TabularConfig has the keys name, samples, features, "
                         "classes, class_separation, data_seed, eval_fraction, hidden_sizes, dropout.",
        "task.classes=1": "task.classes must be 2 or more, got 1.",
        # Hydra's refusal of a typo (before the task's package is imported), in our words.
        "task.hiden=3": f"unknown configuration key task.hiden; python -m app --config-dir {example / 'conf'} "
                        "task=tabular --cfg job lists the keys.",
    }
    procs = {override: start(example, "task=tabular", override, f"hydra.run.dir=refused_{i}")
             for i, override in enumerate(cases)}  # side by side, to save time
    monkeypatch.syspath_prepend(str(example))
    with pytest.raises(ConfigError, match=r"^task\.classes is refused by TabularConfig: Value 'x' of type 'str' "
                                          r"could not be converted to Integer\.$"):
        typed_task_config({"_target_": "tabular_task.TabularTask", "classes": "x"})
    for override, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        message = cases[override]
        assert proc.returncode == 2 and "Traceback" not in err, (override, err[-2000:])
        assert err.strip().splitlines()[-1] == f"error: {message}", override


class NoSchema:
    """A task class without config_class."""

    def build_data(self, runtime): ...
    def build_model(self): ...
    def step(self, model, batch): ...
    def compute_metrics(self, logits, labels): ...
    def save_artifacts(self, model, folder): ...


class NotATask:
    config_class = NoSchema


def test_a_target_that_is_no_task_is_refused_in_one_sentence():
    from app.config import ConfigError
    from app.tasks.external import typed_task_config

    cases = {
        "nopkg.Task": "task._target_=nopkg.Task cannot be imported (No module named 'nopkg'); run from the folder "
                      "that holds its package, or install it (pip install -e <folder>).",
        "tests.test_examples.Missing": "task._target_=tests.test_examples.Missing: module tests.test_examples has no "
                                       "Missing.",
        "tests.test_examples.NotATask": "task._target_=tests.test_examples.NotATask is not a task: it has no "
                                        "build_data, build_model, step, compute_metrics, save_artifacts (the Task "
                                        "protocol, app/tasks/base.py).",
        "tests.test_examples.NoSchema": "task._target_=tests.test_examples.NoSchema has no config_class, a dataclass "
                                        "subclassing app.config.TaskConfig that lists its configuration keys.",
    }
    for target, message in cases.items():
        with pytest.raises(ConfigError) as refused:
            typed_task_config({"_target_": target, "name": "x"})
        assert str(refused.value) == message, target


@pytest.mark.timeout(400)
def test_the_sft_chat_example_runs_as_its_readme_shows(tmp_path):
    """``examples/sft_chat``: the README's command, run from the repository's root as written, trains,
    writes its samples at each evaluation, and exports a model that chats."""
    import re
    import shlex

    from transformers import AutoModelForCausalLM, AutoTokenizer

    readme = (REPO / "examples" / "sft_chat" / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL)
    assert block is not None
    words = shlex.split(block.group(1).replace("\\\n", " "))
    assert words[:3] == ["python", "-m", "app"]
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "app", *words[3:], *QUIET, f"hydra.run.dir={run}",
                           f"task.cache_dir={tmp_path / 'cache'}"], check=False, cwd=REPO, env=ONE_THREAD, capture_output=True,
                          text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/loss" in e]
    assert [e["step"] for e in evals] == [20, 40] and evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    for step in (20, 40):
        rows = [json.loads(x) for x in (run / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all(r["prompt"].endswith("<|im_start|>assistant\n") for r in rows)
    tok = AutoTokenizer.from_pretrained(run / "model")
    model = AutoModelForCausalLM.from_pretrained(run / "model")
    inputs = tok.apply_chat_template([{"role": "user", "content": "what did the cat do ?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert model.generate(**inputs, max_new_tokens=16, do_sample=False).shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_grpo_arithmetic_example_runs_as_its_readme_shows_and_its_exact_answer_reward_rises(tmp_path):
    """``examples/grpo_arithmetic``: the README's command, run from the example's folder as written (its rewards
    module found in the working directory), learns the format, and the exact-answer reward rises."""
    import re
    import shlex

    folder = REPO / "examples" / "grpo_arithmetic"
    readme = (folder / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL)
    assert block is not None
    cd, command = block.group(1).replace("\\\n", " ").strip().split("\n", 1)
    assert cd == "cd examples/grpo_arithmetic"
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "app"]
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "app", *words[3:], *QUIET, f"hydra.run.dir={run}",
                           f"task.cache_dir={tmp_path / 'cache'}"], check=False, cwd=folder,
                          env={**ONE_THREAD, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/reward" in r]
    exact = [r["train/rewards/exact_answer/mean"] for r in rows]
    assert rows[-1]["train/rewards/starts_with_a_number/mean"] > 0.95 > rows[0]["train/rewards/starts_with_a_number/mean"]
    assert sum(exact[-5:]) / 5 > 3 * exact[0], exact
    assert (run / "model" / "model.safetensors").exists() and (run / "completions.jsonl").exists()
