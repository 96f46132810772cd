"""Bad rows as they come (issue 47): a 250-row JSON Lines file with a dozen kinds of bad rows, each kind twice.
``task.bad_rows=refuse`` (the default) reads it whole and refuses it in one sentence that counts every bad row
and names the first few; ``skip`` trains on the rest, writes each bad row to ``<run>/skipped_rows.jsonl`` with
its line and reason, and counts them in the log's ``data:`` line; more than ``task.max_bad_fraction`` bad is
refused all the same. Streamed, the same, each bad row named by its byte offset, on one process and two."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest

from app.config import ConfigError
from app.tasks.sft.config import BadRows, SFTConfig
from app.tasks.sft.task import SFTTask
from tests.conftest import run_app
from tests.helpers.bad_rows import write_bad_file
from tests.helpers.tiny_chat import make_tiny_chat_llama

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")


class OneProcess:
    """The runtime as a task sees it in build_data, on one process."""

    is_main_process = True
    static_shapes = False
    num_processes = 1
    process_index = 0

    def main_process_first(self):
        return nullcontext()

    def register_for_checkpointing(self, *objects) -> None:
        pass

    def gather_object(self, obj):
        return list(obj)


@pytest.fixture(scope="module")
def bad_file(tmp_path_factory) -> tuple[Path, dict[int, str], Path]:
    folder = tmp_path_factory.mktemp("bad_rows")
    expected = write_bad_file(folder / "chat.jsonl")
    return folder / "chat.jsonl", expected, make_tiny_chat_llama(folder / "model")


def task_for(path: Path, model: Path, tmp_path: Path, **keys) -> SFTTask:
    cfg = SFTConfig(config=str(model), cache_dir=str(tmp_path / "cache"), block_size=256, packing=False, **keys)
    cfg.data_files.train = str(path)
    return SFTTask(cfg)


def byte_offsets(path: Path) -> dict[int, int]:
    """Each line's number -> the byte offset it starts at."""
    offsets, at = {}, 0
    for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        offsets[number] = at
        at += len(line) + 1
    return offsets


@pytest.mark.parametrize("streaming", [False, True])
def test_refuse_counts_every_bad_row_and_names_the_first_few(bad_file, tmp_path, streaming):
    """Streamed, the file's first 10 records are held out for evaluation; the stream's 240 are scanned."""
    path, expected, model = bad_file
    task = task_for(path, model, tmp_path, streaming=streaming, eval_documents=10)
    with pytest.raises(ConfigError) as refused:
        task.build_data(OneProcess())
    message = str(refused.value)
    if streaming:
        offsets = byte_offsets(path)
        named = [f"byte {offsets[n]}: {expected[n]}" for n in sorted(expected)[:3]]
        assert message.startswith(f"{path} has {len(expected)} bad row(s) of 240: ")
    else:
        named = [f"line {n}: {expected[n]}" for n in sorted(expected)[:3]]
        assert message.startswith(f"{path} has {len(expected)} bad row(s) of 250: ")
    assert all(clause in message for clause in named), message
    assert f"and {len(expected) - 3} more — fix them, or train on the others with task.bad_rows=skip" in message
    assert "\n" not in message


def test_skip_trains_on_the_rest_and_keeps_each_bad_row_with_its_reason(bad_file, tmp_path):
    path, expected, model = bad_file
    task = task_for(path, model, tmp_path, bad_rows=BadRows.skip)
    data = task.build_data(OneProcess())
    skipped = task.skipped_rows()
    assert [row["line"] for row in skipped] == sorted(expected)
    for row in skipped:
        assert row["file"] == str(path) and row["reason"].startswith(f"{path} line {row['line']}: ")
        assert expected[row["line"]] in row["reason"]
    lines = path.read_bytes().split(b"\n")
    assert skipped[0]["row"] == lines[skipped[0]["line"] - 1].decode("utf-8", "replace").strip()
    assert len(data.train) + len(data.eval) == 250 - len(expected)
    summary = " | ".join(task.data_summary())
    assert f"train: {250 - len(expected)} conversations of {path}" in summary
    assert f"{len(expected)} bad row(s) skipped (skipped_rows.jsonl)" in summary


def test_too_many_bad_rows_are_refused_even_when_skipping(bad_file, tmp_path):
    path, expected, model = bad_file
    task = task_for(path, model, tmp_path, bad_rows=BadRows.skip, max_bad_fraction=0.05)
    with pytest.raises(ConfigError, match=f"has {len(expected)} bad rows of 250 \\(10%\\), more than "
                                          "task.max_bad_fraction=0.05: line "):
        task.build_data(OneProcess())


def test_a_streamed_files_bad_rows_are_skipped_by_byte_offset(bad_file, tmp_path):
    path, expected, model = bad_file
    task = task_for(path, model, tmp_path, bad_rows=BadRows.skip, streaming=True, eval_documents=10)
    task.build_data(OneProcess())
    offsets = byte_offsets(path)
    assert [row["byte"] for row in task.skipped_rows()] == [offsets[n] for n in sorted(expected)]
    assert all(expected[n] in row["reason"] for n, row in zip(sorted(expected), task.skipped_rows(), strict=True))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("streaming", [False, pytest.param(True, marks=pytest.mark.multiprocess)])
def test_a_run_skipping_bad_rows_writes_skipped_rows_jsonl(bad_file, tmp_path, streaming):
    """As a user runs it (streamed: on two processes, each scanning its part of the file), the log's data line
    counts the bad rows and ``skipped_rows.jsonl`` holds every one of them, once."""
    path, expected, model = bad_file
    run = tmp_path / "run"
    hardware = ("hardware=multi_cpu", "hardware.num_processes=2") if streaming else ()
    proc = run_app("task=sft", f"task.config={model}", f"task.data_files.train={path}", "task.bad_rows=skip",
                   f"task.streaming={str(streaming).lower()}", "task.eval_documents=10", "task.block_size=256",
                   *hardware, "trainer.max_steps=2", "trainer.batch_size=2",
                   f"task.cache_dir={tmp_path / 'cache'}", *QUIET, f"hydra.run.dir={run}", cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "skipped_rows.jsonl").read_text().splitlines()]
    assert len(rows) == len(expected)  # each once, though two processes found them
    places = sorted(row["byte" if streaming else "line"] for row in rows)
    assert places == sorted(byte_offsets(path)[n] for n in expected) if streaming else places == sorted(expected)
    log = (run / "app.log").read_text()
    assert "bad row(s) skipped (skipped_rows.jsonl)" in log
    assert f"{len(expected)} bad row(s) left out of the data, each with its reason: {run / 'skipped_rows.jsonl'}" in log
