"""What a user sees in a terminal: whole log lines around the progress bar (a real terminal, tmux),
the bar closed saying why training stopped, rounded metrics, the config tree and model summary at
start, and ``--help``."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.console.config_tree import show_config
from app.engine.progress import human, human_metrics
from tests.conftest import REPO, compose_config, run_app
from tests.helpers.tmux import Terminal, app_command

LOG_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[")


def run_in_terminal(tmp_path: Path, *args: str, timeout: float = 120, width: int = 150) -> tuple[str, str]:
    """Run ``python -m app`` in a detached tmux terminal; the whole screen history, plain and with colours."""
    with Terminal(tmp_path, app_command(*args), width=width) as term:
        screen = term.wait_for_exit(timeout)
        return screen, term.screen("-e")


@pytest.mark.timeout(180)
def test_log_lines_never_land_on_the_bar_and_the_bar_says_why_it_stopped(tmp_path):
    # Early stopping after the second evaluation (nothing improves by 1.0), with bars on.
    # 100 columns: the bar's last line, with why training stopped, is longer than that.
    screen, coloured = run_in_terminal(
        tmp_path, "hydra.run.dir=run", "trainer.max_epochs=5", "trainer.eval_every_n_steps=10",
        "early_stopping.patience=1", "early_stopping.min_delta=1", "logging.trackers=[]", "logging.print_config=true",
        width=100)
    assert "EXIT=0" in screen, screen
    lines = [line.rstrip() for line in screen.splitlines() if line.strip()]
    log_lines = [line for line in lines if LOG_LINE.search(line)]
    assert len(log_lines) >= 4, screen
    for line in log_lines:
        assert LOG_LINE.match(line), f"a log line shares its line with something else:\n{line}"
        assert len(LOG_LINE.findall(line)) == 1, line
    bars = [line for line in lines if line.startswith("train:")]
    assert bars and all(not LOG_LINE.search(b) for b in bars)
    # It fits the width, whole words only: the reason is cut at a word (…), its "(best …)" kept.
    last = bars[-1]
    assert len(last) <= 100 and last.endswith(")]"), last
    stop = re.search(r"stopped: (.*) \(best \d\.\d{4}\)\]$", last)
    assert stop, last
    words = ["eval/accuracy", "did", "not", "improve", "for", "1", "evaluations"]
    shown = stop.group(1).removesuffix("…").split()
    assert shown == words[:len(shown)] and (len(shown) == len(words) or stop.group(1).endswith("…")), last
    assert "/225 " in bars[-1]  # the planned steps: 5 epochs of 45 steps
    evaluations = [line for line in log_lines if "eval/accuracy=" in line]
    assert evaluations and all(re.search(r"eval/accuracy=\d\.\d{4}(,|$)", e) for e in evaluations)
    assert "eval/num_samples=360" in evaluations[0]
    stopped = next(line for line in log_lines if "stopped:" in line)
    # ... the step of the best, and the run's mean throughput (no MFU on a CPU: its peak is in no table).
    assert re.search(r"best eval/accuracy = \d\.\d{4} \(step \d+\); throughput mean \d+ samples/s, MFU n/a$",
                     stopped), stopped
    # At start, asked for: the config as a tree (coloured on this terminal, plain in the run folder) and the model.
    assert "├── trainer" in screen and "│   ├── max_epochs: 5" in screen
    assert re.search(r"\x1b\[[0-9;]*m(\x1b\[[0-9;]*m)?trainer", coloured)  # colours on a terminal
    # Each checkpoint's line (saved, rotated) is in app.log, relative to the run folder, not on the terminal.
    assert "checkpoint_" not in screen, screen
    assert re.search(r"\]\[DEBUG\] - saved checkpoint checkpoints/checkpoint_0 \(step 20\)$",
                     (tmp_path / "run" / "app.log").read_text(), re.MULTILINE)
    summary = next(line for line in log_lines if "parameters (" in line)
    assert re.search(r"training digits on 1 process\(es\); model MLP: [\d,]+ parameters \([\d,]+ trainable, "
                     r"100 %; 0 frozen\), [\d.]+ MB; hardware cpu on cpu, precision no, 1 thread \(small model\)", summary), summary


@pytest.mark.timeout(150)
def test_a_two_step_sft_run_shows_its_overrides_and_where_the_config_is_not_the_tree(tmp_path):
    """The SFT example for 2 steps fits a screen: the config is one line with the overrides (the tree, 99
    lines of it, is in app.log and the values in .hydra/config.yaml)."""
    example = REPO / "examples" / "sft_chat"
    screen, _ = run_in_terminal(tmp_path, "task=sft", f"task.config={example / 'tiny-chat-llama'}",
                                f"task.data_files.train={example / 'chat.jsonl'}", "trainer.max_steps=2",
                                "logging.trackers=[]", "hydra.run.dir=run")
    lines = [line for line in screen.splitlines() if line.strip()]
    assert lines[-1] == "EXIT=0", screen
    assert len(lines) <= 12 and not [line for line in lines if line[:1] in "│├└"], screen
    config = [line for line in lines if "[app][INFO] - config: " in line]
    assert len(config) == 1 and config[0].endswith(
        f"config: the defaults with task=sft task.config={example / 'tiny-chat-llama'} task.data_files.train="
        f"{example / 'chat.jsonl'} trainer.max_steps=2 logging.trackers=[] (the whole config: .hydra/config.yaml and "
        "app.log in the run folder; logging.print_config=true prints it here)"), config
    log = (tmp_path / "run" / "app.log").read_text()
    assert "[app][DEBUG] - config\n├── task\n│   ├── name: sft\n" in log and "│   ├── max_steps: 2\n" in log
    assert "max_steps: 2" in (tmp_path / "run" / ".hydra" / "config.yaml").read_text()


def test_config_tree_is_plain_when_not_on_a_terminal():
    out = io.StringIO()
    show_config(compose_config("trainer.max_epochs=3"), out)
    assert "├── trainer\n│   ├── max_epochs: 3\n" in out.getvalue() and "\x1b" not in out.getvalue()


def test_human_numbers_are_rounded():
    assert human(0.9694444537162781) == "0.9694"
    assert human(360) == "360"
    assert human(2.5e-5) == "2.5e-05"
    assert human_metrics({"eval/f1": 0.87654, "epoch": 2}, prefix="eval/") == "eval/f1=0.8765"


def test_help_lists_every_option_once_with_keys_and_examples_and_no_schemas(tmp_path):
    proc = run_app("--help", cwd=tmp_path, check=True, timeout=60)
    text = proc.stdout
    assert "_schema" not in text and "Could not find" not in text + proc.stderr
    conf = REPO / "conf"
    for group in {p.parent for p in conf.rglob("*.yaml") if p.parent != conf}:
        assert f"\n  {group.relative_to(conf).as_posix()}" in text
        for option in group.glob("*.yaml"):
            assert re.search(rf"^   [ *] {re.escape(option.stem)}\s", text, re.MULTILINE), option
    assert re.search(r"^   \* cpu\s", text, re.MULTILINE)  # the default is marked
    assert "keys: trainer.max_epochs, trainer.max_steps" in text
    assert "python -m app hardware=multi_cpu hardware.num_processes=2" in text  # the README's examples
    # Every launcher, Hydra's and its plugins' included, basic the default.
    launchers = text.split("\n  hydra/launcher\n", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^   ([ *]) (\w+)", launchers, re.MULTILINE) == [
        ("*", "basic"), (" ", "joblib"), (" ", "local_parallel"), (" ", "slurm"), (" ", "submitit_local")]
    # Each option's first sentence whole, never cut at a line of its file.
    options = re.findall(r"^   [ *] (\w+)\s+(.+)$", text, re.MULTILINE)
    for name, description in options:
        # A sentence, or (an option without one) the keys it sets and their values.
        assert description.endswith(".") or re.match(r"^_?\w+: ", description), (name, description)
        assert not description.endswith(("\\", "(", ",", ":")) and " \\ " not in description, (name, description)
    # The values shown are the ones the default run uses (the digits task's recipe over the groups').
    default = compose_config()
    assert re.search(rf"^   \* adamw\s+lr: {default.optim.lr} ", text, re.MULTILINE), text
    assert re.search(rf"^   \* default\s+max_epochs: {default.trainer.max_epochs} ", text, re.MULTILINE)


def test_help_lists_every_key_of_the_chosen_task_and_adapter(tmp_path):
    import dataclasses

    from app.config import LoraAdapterConfig
    from app.tasks.causal_lm.config import CausalLMConfig, LMDataFiles

    text = run_app("task=causal_lm", "adapter=lora", "--help", cwd=tmp_path, check=True, timeout=60).stdout
    assert re.search(r"^   \* causal_lm\s", text, re.MULTILINE) and re.search(r"^   \* lora\s", text, re.MULTILINE)
    nested = {"data_files": [f"data_files.{f.name}" for f in dataclasses.fields(LMDataFiles)]}
    task_keys = [key for f in dataclasses.fields(CausalLMConfig) if f.name != "name"
                 for key in nested.get(f.name, [f.name])]
    assert f"keys: {', '.join('task.' + k for k in task_keys)}\n" in text, text
    assert f"keys: {', '.join('adapter.' + f.name for f in dataclasses.fields(LoraAdapterConfig))}\n" in text
    assert "config_overrides" in task_keys and "adapter.r" in text
    # The chosen task's recipe is the one the values show.
    assert re.search(r"^   \* default\s+max_epochs: 1 \(the causal_lm task's", text, re.MULTILINE)


@pytest.mark.timeout(120)
def test_a_run_redirected_to_a_file_writes_plain_lines_without_redraws_or_colours(tmp_path):
    log_file = tmp_path / "run.log"
    with log_file.open("w") as out:  # python -m app ... > run.log 2>&1
        proc = subprocess.run([sys.executable, "-m", "app", "hydra.run.dir=run", "trainer.max_epochs=2",
                               "logging.trackers=[]", "checkpoint.total_limit=1", "checkpoint.keep_best=false",
                               # The last weights exported: no best evaluation's weights keep a checkpoint.
                               "checkpoint.export=last"], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=110, check=False)
    text = log_file.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text and "\x1b" not in text, repr(text[-2000:])  # no bar redraws, no colours
    # The config in one line, its tree in app.log (logging.print_config=false, the default).
    assert "├── trainer" not in text and "├── trainer" in (tmp_path / "run" / "app.log").read_text()
    assert re.search(r"\]\[app\]\[INFO\] - config: the defaults with trainer\.max_epochs=2 logging\.trackers=\[\] "
                     r".* \(the whole config: \.hydra/config\.yaml and app\.log in the run "
                     r"folder; logging\.print_config=true prints it here\)$", text, re.MULTILINE), text[:3000]
    # The bar became one line per tenth of the 90 steps, each at a log step, with that step's loss.
    progress = re.findall(r"\[app\.engine\.progress\]\[INFO\] - train: (\d+)/90 steps \(\d+%\), loss=\d\.\d{4}, "
                          r"\d+ samples/s$", text, re.MULTILINE)
    assert [int(step) for step in progress] == list(range(10, 91, 10)), text[-3000:]
    assert all(LOG_LINE.match(line) for line in text.splitlines()), text[-3000:]
    # The epochs' checkpoint lines, relative to the run folder, are in app.log only (issue 29, item 10).
    assert "checkpoint_" not in text, text[-3000:]
    details = re.findall(r"\]\[DEBUG\] - (.*checkpoint_.*)$", (tmp_path / "run" / "app.log").read_text(), re.MULTILINE)
    assert details == ["saved checkpoint checkpoints/checkpoint_0 (step 45)",
                       "saved checkpoint checkpoints/checkpoint_1 (step 90)",
                       "removed old checkpoint checkpoints/checkpoint_0 (checkpoint.total_limit=1)"], details


@pytest.mark.timeout(180)
def test_a_sweep_keeps_each_jobs_config_tree_and_details_to_its_log(tmp_path):
    # Hydra's basic launcher runs the three jobs one after another in one process; a checkpoint every 5
    # steps gives each job its saved/removed lines (DEBUG), which once reached the terminal from job 1 on.
    screen, _ = run_in_terminal(
        tmp_path, "-m", "optim.lr=1e-3,3e-3,1e-2", "trainer.max_epochs=-1", "trainer.max_steps=20",
        "checkpoint.every_n_steps=5", "checkpoint.total_limit=1", "logging.trackers=[]", "hydra.sweep.dir=sweep")
    assert "EXIT=0" in screen, screen[-3000:]
    assert "├── trainer" not in screen and "config: the defaults" not in screen, screen  # the trees: in the logs
    assert [re.search(r"#(\d) : optim\.lr=", line).group(1) for line in screen.splitlines() if " : optim.lr=" in line] \
        == ["0", "1", "2"]  # then each job's overrides (Hydra's launcher line)
    assert "DEBUG" not in screen and "checkpoint_" not in screen, screen
    for job in ("0", "1", "2"):
        log = (tmp_path / "sweep" / job / "app.log").read_text()
        assert "[DEBUG] - saved checkpoint checkpoints/checkpoint_3 (step 20)" in log, log
        assert "├── trainer" in log, log  # each job's tree: in its own log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_other_libraries_chatter_stays_off_the_terminal_and_goes_to_app_log(tmp_path, text_model):
    pytest.importorskip("peft")
    pytest.importorskip("mlflow")
    from transformers import AutoTokenizer, BertModel

    from tests.helpers.text_data import pair_rows, write_csv

    # A checkpoint without a classifier (transformers' load report: the head it initialises), LoRA (peft
    # calls an API transformers deprecates: a FutureWarning), MLflow (its tables created), an export
    # (transformers' "Writing model shards" bar).
    base = tmp_path / "encoder"
    BertModel.from_pretrained(text_model).save_pretrained(base)
    AutoTokenizer.from_pretrained(text_model).save_pretrained(base)
    write_csv(tmp_path / "train.csv", ["question", "answer", "label"], pair_rows(64, 1))
    args = ("task=text_classification", "task.data_files.train=train.csv", "task.text_fields=[question,answer]",
            f"task.model={base}", "adapter=lora", "logging.trackers=[mlflow]", "trainer.max_steps=4",
            "trainer.batch_size=8", "logging.print_config=false")
    screen, _ = run_in_terminal(tmp_path, *args, "hydra.run.dir=run", timeout=240)
    assert "EXIT=0" in screen, screen[-3000:]
    with (tmp_path / "redirected.log").open("w") as out:  # python -m app ... > redirected.log 2>&1
        subprocess.run([sys.executable, "-m", "app", *args, "hydra.run.dir=redirected"], stdout=out,
                       stderr=subprocess.STDOUT, cwd=tmp_path, timeout=240, check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    redirected = (tmp_path / "redirected.log").read_text()
    for shown in (screen, redirected):
        for chatter in ("Loading weights", "Writing model shards", "LOAD REPORT", "MLflow database tables",
                        "FutureWarning", "[transformers]"):
            assert chatter not in shown, (chatter, shown[-3000:])
        # Our own lines whole, the export's last (nothing glued onto it).
        assert re.search(r"\]\[app\.engine\.checkpoint\]\[INFO\] - exported the \w+ weights \(.*\) to \S+/model$",
                         shown.rstrip().splitlines()[-1 if shown is redirected else -2]), shown[-1500:]
    assert "\r" not in redirected and "\x1b" not in redirected, repr(redirected[-2000:])
    # What they said is in the run's log, in plain text.
    log = (tmp_path / "run" / "app.log").read_text()
    assert "\x1b" not in log
    assert re.search(r"\]\[transformers\.\S+\]\[WARNING\] - BertForSequenceClassification LOAD REPORT from: ", log), log
    assert "classifier.weight | MISSING" in log
    assert "[mlflow.store.db.utils][INFO] - Creating initial MLflow database tables" in log
    assert re.search(r"\]\[py\.warnings\.transformers\]\[WARNING\] - \S+\.py:\d+: FutureWarning: ", log), log


def test_colouring_libraries_write_plain_text_to_a_file(tmp_path):
    # Optuna logs through colorlog, which colours whatever the stream; the app asks for plain text
    # (NO_COLOR) when its stderr is not a terminal, before the sweeper imports Optuna.
    script = ("from app.console.output import protect_output; protect_output(); import optuna; "
              "optuna.logging.get_logger('optuna').info('A new study created')")
    with (tmp_path / "err.log").open("w") as err:
        subprocess.run([sys.executable, "-c", script], stderr=err, cwd=REPO, timeout=60, check=True,
                       env={k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")})
    text = (tmp_path / "err.log").read_text()
    assert "A new study created" in text and "\x1b" not in text, repr(text)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_parallel_optuna_sweep_shows_one_line_per_job_start_and_end(tmp_path):
    # The README's joblib Optuna command, two trials at once on one terminal.
    with Terminal(tmp_path, app_command("-m", "hparams_search=digits_optuna", "hydra/launcher=joblib",
                                        "hydra.sweeper.n_trials=2", "trainer.max_epochs=1", "logging.trackers=[]",
                                        "hydra.sweep.dir=sweep"), width=120) as term:
        screen = term.wait_for_exit(280)
    assert "EXIT=0" in screen, screen[-3000:]
    lines = [line.rstrip() for line in screen.splitlines() if line.strip()]
    # No job's config tree, bar or log line on the shared terminal: one line as each job starts and ends.
    assert not [line for line in lines if line[:1] in "│├└" or line.startswith(("train:", "eval:", "config"))], screen
    assert "█" not in screen and "[app" not in screen, screen
    for job in (0, 1):
        started = [line for line in lines if line.startswith(f"job {job} started: ")]
        ended = [line for line in lines if line.startswith(f"job {job} finished (eval/accuracy 0.")]
        assert len(started) == len(ended) == 1, screen
        assert started[0].endswith(f"({tmp_path / 'sweep' / str(job)})") and "optim.lr=" in started[0]
        assert ended[0].endswith(f"its log: {tmp_path / 'sweep' / str(job) / 'app.log'}")
        # What the terminal did not show is in the job's own log: the tree, the progress, the evaluation.
        log = (tmp_path / "sweep" / str(job) / "app.log").read_text()
        assert "├── trainer" in log and re.search(r"train: \d+/\d+ steps", log) and "eval/accuracy=" in log
    assert all(line.startswith(("[", "job ", "EXIT=")) for line in lines), screen  # whole lines only


RELAYED = """
import os, signal, sys, time, warnings
from app.console.native_stderr import native_stderr_to_log
from app.console.output import protect_output

protect_output()
with native_stderr_to_log(["GSPMD sharding propagation", "Failed to deserialize"], sys.argv[1], "torch_xla"):
    # What torch_xla's C++ writes, straight to fd 2: two notices and a real error.
    os.write(2, b"W sharding_propagation.cc:3120] GSPMD sharding propagation is going to be deprecated\\n")
    os.write(2, b"E pjrt_computation_client.cc:1] a real XLA error\\n")
    os.write(2, b"W pjrt_computation_client.cpp:694] Failed to deserialize executable: UNIMPLEMENTED\\n")
    warnings.warn("a Python warning, on the terminal as ever")
    print(f"stderr is a terminal: {sys.stderr.isatty()}", file=sys.stderr, flush=True)

    def dying(signum, frame):
        os.write(2, b"F check failed after Ctrl-C: the last words of a dying process\\n")
        os.abort()  # no atexit, no flush: only a reader outside this process can still pass the line on

    signal.signal(signal.SIGINT, dying)
    print("waiting for Ctrl-C", file=sys.stderr, flush=True)
    while True:
        time.sleep(0.05)
"""


@pytest.mark.signals
@pytest.mark.timeout(60)
def test_native_notices_go_to_the_log_and_a_real_error_reaches_the_terminal_even_from_a_dying_process(tmp_path):
    """hardware=tpu's terminal shows our lines: torch_xla's C++ notices (written to fd 2 by native
    code) go to app.log, while any other line, a real error written just before an abort() included,
    still reaches the terminal; the relay that sorts them outlives the terminal's Ctrl-C."""
    (tmp_path / "relayed.py").write_text(RELAYED)
    log = tmp_path / "app.log"
    command = f"PYTHONPATH={REPO} {sys.executable} relayed.py {log}"
    with Terminal(tmp_path, command) as term:
        assert "waiting for Ctrl-C" in term.wait_for("waiting for Ctrl-C", 30), term.screen()
        term.send_keys("C-c")
        screen = term.wait_for("the last words of a dying process", 30)
        screen = term.wait_for("EXIT=", 30) if "EXIT=" not in screen else screen
    assert "E pjrt_computation_client.cc:1] a real XLA error" in screen, screen
    assert "F check failed after Ctrl-C: the last words of a dying process" in screen, screen
    assert "UserWarning: a Python warning, on the terminal as ever" in screen
    assert "stderr is a terminal: True" in screen  # progress bars stay bars
    assert "GSPMD" not in screen and "deserialize" not in screen, screen
    assert "EXIT=134" in screen, screen  # SIGABRT
    kept = log.read_text().splitlines()
    assert len(kept) == 2 and all(LOG_LINE.match(line) and "][torch_xla][WARNING] - W " in line for line in kept), kept
    assert "GSPMD sharding propagation" in kept[0] and "Failed to deserialize executable" in kept[1]


def test_a_plain_progress_line_gives_the_tasks_training_metrics(caplog, monkeypatch):
    """Where no bar is drawn, the plain line has the task's own training metrics (``train/<name>``,
    without the prefix) between the loss and the throughput."""
    import logging

    from app.engine import progress as progress_module

    monkeypatch.setattr(progress_module, "draws_bars", lambda: False)
    progress = progress_module.Progress(10, enabled=True)
    progress.update(1)
    with caplog.at_level(logging.INFO, logger="app.engine.progress"):
        progress.show(0.69, {"train/samples_per_s": 12.0}, {"train/rewards/accuracies": 0.75, "train/logps/chosen": -12.5})
        progress.update(1)
        progress.show(0.5, {"train/samples_per_s": 12.0})
    assert [r.getMessage() for r in caplog.records if r.name == "app.engine.progress"] == [
        "train: 1/10 steps (10%), loss=0.6900, rewards/accuracies=0.7500, logps/chosen=-12.5000, 12 samples/s",
        "train: 2/10 steps (20%), loss=0.5000, 12 samples/s"]
