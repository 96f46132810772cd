"""Output to a pipe that closed (``python -m app ... | tee run.log``: the terminal's Ctrl-C ends ``tee``
too) never costs the run its checkpoint: every write path drops what it writes there (the bar, the
log handlers, the signal's own message, the config tree, an ``error:`` line, Hydra's own output),
the run saves and exits 130, and ``app.log`` keeps everything."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from app.console.config_tree import show_config
from app.console.output import ClosedPipeSafe, write_raw
from app.distributed.checkpoint.store import complete_checkpoints
from tests.conftest import REPO, compose_config
from tests.helpers.tmux import Terminal, app_command


@pytest.fixture
def closed_pipe() -> Iterator[tuple[int, io.TextIOWrapper]]:
    """The writing end of a pipe whose reader has gone (``tee`` ended), as a text stream."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    stream = open(write_fd, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed below
    yield write_fd, stream
    stream.close()


def goes_nowhere(fd: int) -> bool:
    return os.readlink(f"/proc/self/fd/{fd}") == os.devnull


def bar_writes(stream: ClosedPipeSafe) -> None:
    from tqdm.contrib.logging import logging_redirect_tqdm
    from tqdm.std import tqdm

    logger = logging.getLogger("closed-pipe-test")
    logger.addHandler(logging.StreamHandler(stream))  # type: ignore[arg-type]
    bar = tqdm(total=10, file=stream, mininterval=0)
    with logging_redirect_tqdm(loggers=[logger], tqdm_class=tqdm):
        for _ in range(10):
            bar.update()
            logger.warning("a log line through the bar")
    bar.close()


def log_writes(stream: ClosedPipeSafe) -> None:
    handler = logging.StreamHandler(stream)  # type: ignore[arg-type]
    handler.handleError = lambda record: pytest.fail("the handler failed on a closed pipe")  # type: ignore[method-assign]
    record = logging.LogRecord("app", logging.INFO, __file__, 1, "saved checkpoint %s", ("x",), None)
    for _ in range(3):
        handler.emit(record)


WRITE_PATHS: dict[str, Callable[[ClosedPipeSafe], None]] = {
    "bar": bar_writes,
    "log handler": log_writes,
    "config tree": lambda stream: show_config(compose_config(), stream),  # type: ignore[arg-type]
    "error line": lambda stream: print("error: one sentence.", file=stream, flush=True),
}


@pytest.mark.parametrize("path", sorted(WRITE_PATHS))
def test_each_write_path_drops_its_output_to_a_closed_pipe(closed_pipe, path):
    fd, stream = closed_pipe
    safe = ClosedPipeSafe(stream)
    WRITE_PATHS[path](safe)  # raises BrokenPipeError without the guard
    assert goes_nowhere(fd)  # and every later write, Python's or C's, is dropped too
    safe.write("more\n")
    safe.flush()


@pytest.mark.signals
def test_the_signal_handlers_raw_message_drops_on_a_closed_pipe(closed_pipe):
    fd, _ = closed_pipe
    write_raw(fd, "\nSIGINT: stopping after the current step and saving a checkpoint\n")  # no BrokenPipeError
    assert goes_nowhere(fd)
    write_raw(fd, "\nsecond interrupt: exiting now\n")


@pytest.mark.timeout(60)
def test_hydras_own_output_to_a_closed_stdout_is_no_error(tmp_path):
    # Hydra prints the composed config itself (--cfg job); its reader is gone before it starts.
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "app", "--cfg", "job"], stdout=write_fd, stderr=subprocess.PIPE,
                          cwd=tmp_path, env=env, text=True, timeout=50, check=False)
    os.close(write_fd)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]


@pytest.mark.signals
@pytest.mark.timeout(180)
def test_ctrl_c_through_tee_saves_the_checkpoint_and_exits_130(tmp_path):
    run = tmp_path / "run"
    args = ("trainer.max_epochs=-1", "trainer.max_steps=1000000", "scheduler=constant", "logging.trackers=[]",
            "early_stopping.patience=null", "checkpoint.export=last", f"hydra.run.dir={run}")
    with Terminal(tmp_path, f"{app_command(*args)} | tee run.log", width=120) as term:
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while "train/loss" not in (metrics.read_text() if metrics.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)  # until it has trained a few steps
        term.send_keys("C-c")  # the terminal's SIGINT: to the run and to tee
        screen = term.wait_for_exit()
    assert "EXIT=130" in screen, screen[-3000:]
    for word in ("Traceback", "BrokenPipeError", "Logging error"):
        assert word not in screen, screen[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "interrupted", result
    # The newest checkpoint is the interrupt's, at the step it stopped (an epoch's end may have saved one
    # before the Ctrl-C: the digits epoch is 45 steps, a fraction of a second on an idle machine).
    manifest = max((m for _, m in complete_checkpoints(run / "checkpoints")), key=lambda m: m.step)
    assert manifest.step == result["steps"] > 0
    # What the dead pipe did not show, the run's log has: the checkpoint and how to resume.
    log = (run / "app.log").read_text()
    assert f"interrupted (SIGINT) at step {manifest.step}; resume with: python -m app resume={run}" in log
    assert f"run folder {run}\n" in (tmp_path / "run.log").read_text()  # tee wrote until Ctrl-C ended it
