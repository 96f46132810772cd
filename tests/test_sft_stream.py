"""``task.streaming=true`` for ``task=sft`` (issue 38): the training JSON Lines file read line by line,
tokenized and labelled as the map-style rows are, packed per read-ahead group; a stream's position
saved mid-way resumes with exactly the rows the uninterrupted stream gives next; a real ``python -m app``
run SIGKILLed half-way through a save and resumed ends with the uninterrupted run's weights bitwise
(one process, and two on gloo)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from app.tasks.sft.config import DataFormat, SFTConfig
from app.tasks.sft.records import Places
from app.tasks.sft.stream import ConversationStream, scan
from app.tasks.sft.tokens import Recipe, bad_records, encode_texts
from tests.helpers.tiny_chat import conversations, make_tokenizer, write_jsonl
from tests.test_sft import FIELDS
from tests.test_sft_engine import assert_bitwise_equal, chat, killed_and_resumed  # noqa: F401 - the fixture


def recipe_of(path: Path) -> Recipe:
    return Recipe(DataFormat.messages, FIELDS, SFTConfig().train_on, 160, SFTConfig().overlong,
                  Places(str(path), "byte"))


def stream_of(path: Path, packing: bool, begin: int = 0) -> ConversationStream:
    def encode(texts, offsets):
        return encode_texts(texts, offsets, tokenizer=make_tokenizer(), recipe=recipe_of(path))

    return ConversationStream(path, begin, encode, 160, packing)


@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_saved_mid_way_resumes_with_the_rows_that_come_next(tmp_path, packing):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations(150, seed=3)])
    whole = list(stream_of(path, packing))
    if not packing:
        assert len(whole) == 150
    else:  # every conversation once, whole, its positions restarting at 0
        assert sum(row["position_ids"].count(0) for row in whole) == 150
        assert all(len(row["input_ids"]) <= 160 for row in whole) and len(whole) < 150
    for stop in (1, 40, 70, len(whole) - 1):
        stream = stream_of(path, packing)
        taken = list(itertools.islice(iter(stream), stop))
        state = json.loads(json.dumps(stream.state_dict()))  # as a checkpoint keeps it
        again = stream_of(path, packing)
        again.load_state_dict(state)
        assert taken + list(again) == whole, stop


def test_two_parts_read_every_conversation_once(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations(150, seed=3)])
    parts = []
    for index in range(2):
        stream = stream_of(path, False)
        stream.set_shard(index, 2)
        parts.append([tuple(row["input_ids"]) for row in stream])
    assert sorted(parts[0] + parts[1]) == sorted(tuple(r["input_ids"]) for r in stream_of(path, False))
    assert len(parts[0]) + len(parts[1]) == 150 and min(len(parts[0]), len(parts[1])) > 50


def test_a_streamed_files_bad_records_are_found_by_byte_offset_and_left_out(tmp_path):
    """Each process's part is scanned once before training (``SFTTask._check_stream`` judges what it finds):
    the two parts find the file's two bad lines at their byte offsets, a malformed line included, and the
    stream then trains on the good records only."""
    rows = [{"messages": c} for c in conversations(40, seed=3)]
    lines = [json.dumps(r) + "\n" for r in rows]
    lines.insert(10, '{"messages": [{"role": "user"}]}\n')
    lines.insert(30, "{not json\n")
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    offsets = [len("".join(lines[:k]).encode()) for k in (10, 30)]

    def check(texts, places):
        return bad_records(texts, places, tokenizer=make_tokenizer(), recipe=recipe_of(path))

    found = [scan(stream_of(path, False), index, 2, check) for index in range(2)]
    assert sum(read for read, _ in found) == 42
    bad = sorted((b for _, part in found for b in part), key=lambda b: b.place)
    assert [b.place for b in bad] == offsets and [b.unit for b in bad] == ["byte", "byte"]
    assert bad[0].reason == f"{path} at byte {offsets[0]}: message 1 of 'messages' has no 'content'."
    assert bad[1].reason.startswith(f"{path} at byte {offsets[1]}: is not a JSON record") and bad[1].row == "{not json"
    assert len(list(stream_of(path, False))) == 40


def bigger(tmp_path: Path, chat_args: tuple[str, ...]) -> tuple[str, ...]:
    """The engine test's conversations and 200 more (several read-ahead groups), streamed."""
    train = write_jsonl(tmp_path / "stream.jsonl", [{"messages": c} for c in conversations(200, seed=11)])
    return (*chat_args, f"task.data_files.train={train}", "task.streaming=true")


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_streamed_killed_mid_save_and_resumed_ends_with_the_uninterrupted_weights(tmp_path, chat):  # noqa: F811
    reference, resumed = killed_and_resumed(tmp_path, bigger(tmp_path, chat))
    assert "train: streamed from" in (resumed / "app.log").read_text()  # the killed run's start, then the resume's
    assert_bitwise_equal(reference, resumed)


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_streamed_on_two_processes_killed_and_resumed_ends_with_the_uninterrupted_weights(tmp_path, chat):  # noqa: F811
    assert_bitwise_equal(*killed_and_resumed(tmp_path, bigger(tmp_path, chat), "hardware=multi_cpu",
                                             "hardware.num_processes=2"))
