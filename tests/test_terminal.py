"""What a user sees in a terminal: whole log lines around the progress bar (a real terminal, tmux),
the bar closed saying why training stopped, rounded metrics, the config tree and model summary at
start, and ``--help``."""

from __future__ import annotations

import io
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.config_tree import show_config
from app.engine.progress import human, human_metrics
from tests.conftest import REPO, compose_config, run_app

LOG_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[")


def run_in_terminal(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[str, str]:
    """Run ``python -m app`` in a detached tmux terminal; the whole screen history, plain and with colours."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux): the terminal test needs a real terminal")
    server = f"app-test-{tmp_path.name}"
    command = (f"cd {shlex.quote(str(tmp_path))} && PYTHONPATH={shlex.quote(str(REPO))} HF_HUB_OFFLINE=1 "
               f"{shlex.quote(sys.executable)} -m app {' '.join(shlex.quote(a) for a in args)}; "
               "echo EXIT=$?; sleep 600")
    subprocess.run(["tmux", "-L", server, "new-session", "-d", "-x", "150", "-y", "50", command], check=True)

    def capture(*flags: str) -> str:
        return subprocess.run(["tmux", "-L", server, "capture-pane", "-p", "-J", "-S", "-", *flags],
                              capture_output=True, text=True, check=True).stdout

    try:
        deadline = time.monotonic() + timeout
        while "EXIT=" not in (screen := capture()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return screen, capture("-e")
    finally:
        subprocess.run(["tmux", "-L", server, "kill-server"], check=False)


@pytest.mark.timeout(180)
def test_log_lines_never_land_on_the_bar_and_the_bar_says_why_it_stopped(tmp_path):
    # Early stopping after the second evaluation (nothing improves by 1.0), with bars on.
    screen, coloured = run_in_terminal(
        tmp_path, "hydra.run.dir=run", "trainer.max_epochs=5", "trainer.eval_every_n_steps=10",
        "early_stopping.patience=1", "early_stopping.min_delta=1", "logging.trackers=[]")
    assert "EXIT=0" in screen, screen
    lines = [line.rstrip() for line in screen.splitlines() if line.strip()]
    log_lines = [line for line in lines if LOG_LINE.search(line)]
    assert len(log_lines) >= 4, screen
    for line in log_lines:
        assert LOG_LINE.match(line), f"a log line shares its line with something else:\n{line}"
        assert len(LOG_LINE.findall(line)) == 1, line
    bars = [line for line in lines if line.startswith("train:")]
    assert bars and all(not LOG_LINE.search(b) for b in bars)
    assert "stopped: eval/accuracy did not improve for 1 evaluations" in bars[-1], bars[-1]
    assert "/225 " in bars[-1]  # the planned steps: 5 epochs of 45 steps
    evaluations = [line for line in log_lines if "eval/accuracy=" in line]
    assert evaluations and all(re.search(r"eval/accuracy=\d\.\d{4}(,|$)", e) for e in evaluations)
    assert "eval/num_samples=360" in evaluations[0]
    stopped = next(line for line in log_lines if "stopped:" in line)
    assert re.search(r"best eval/accuracy = \d\.\d{4}$", stopped), stopped
    # At start: the config as a tree (coloured on this terminal, plain in the run folder) and the model.
    assert "├── trainer" in screen and "│   ├── max_epochs: 5" in screen
    assert re.search(r"\x1b\[[0-9;]*m(\x1b\[[0-9;]*m)?trainer", coloured)  # colours on a terminal
    summary = next(line for line in log_lines if "parameters (" in line)
    assert re.search(r"training digits on 1 process\(es\); model MLP: [\d,]+ parameters \([\d,]+ trainable, "
                     r"0 frozen\), [\d.]+ MB; hardware cpu on cpu, precision no", summary), summary


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
