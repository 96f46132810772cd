"""``task.streaming=true`` for ``task=sft``: the training JSON Lines file read line by line while training
(never loaded whole), each process its own byte range (``app/tasks/causal_lm/stream.py``'s
``LineStream``: the parts, the seeking, the checks on resume), each record tokenized and labelled as the
map-style rows are (``tokens.encode_rows``), rows with nothing learnt left out, and with
``task.packing=true`` each read-ahead group of conversations packed whole (best-fit decreasing, as
``packing.PackedRows`` packs a split).

What a checkpoint saves: the byte offset after the last line read and the rows already made but not yet
handed out; a resumed run seeks there and goes on exactly, reading nothing before it again.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from app.tasks.causal_lm.stream import READ_AHEAD, LineReader, LineStream
from app.tasks.sft.packing import best_fit_decreasing, packed_row
from app.tasks.sft.records import line_text


def first_records(path: Path, count: int) -> tuple[list[str], list[int], int]:
    """The file's first ``count`` records (their lines' texts), their byte offsets, and the byte after them."""
    texts: list[str] = []
    offsets: list[int] = []
    with open(path, "rb") as f:
        while len(texts) < count:
            offset = f.tell()
            line = f.readline()
            if not line:
                break
            if line.strip():
                texts.append(line_text(line))
                offsets.append(offset)
        return texts, offsets, f.tell()


def read_ahead(f: BinaryIO, end: int) -> tuple[list[str], list[int]]:
    """The next ``READ_AHEAD`` records (their lines' texts) of an open file before byte ``end``, and their
    lines' byte offsets. A bad line is a record all the same: encoding it says why it is bad."""
    texts: list[str] = []
    offsets: list[int] = []
    while len(texts) < READ_AHEAD and f.tell() < end:
        offset = f.tell()
        line = f.readline()
        if line.strip():
            texts.append(line_text(line))
            offsets.append(offset)
    return texts, offsets


def records_read(path: Path, end: int, state: dict[str, Any],
                 rows_of: Callable[[list[str], list[int]], list[Any]]) -> Iterator[Any]:
    """A JSON Lines stream's rows: from its ``state``'s offset (and the rows made but not handed out), the
    records of each read-ahead made into rows by ``rows_of(texts, offsets)``, until byte ``end``."""
    pending: list[Any] = state["pending"]
    with open(path, "rb") as f:
        f.seek(state["offset"])
        while True:
            while pending:
                yield pending.pop(0)  # popped first: state_dict() is then after it
            texts, offsets = read_ahead(f, end)
            state["offset"] = f.tell()
            if not texts:
                return  # the part's end
            pending.extend(rows_of(texts, offsets))


Encode = Callable[[list[str], list[int]], list[dict[str, list[int]]]]
"""Records (their lines' texts) and their byte offsets -> training rows (``input_ids``, ``labels``), bad ones and
those with nothing learnt left out."""


class ConversationStream(LineStream):
    """Rows of one conversation, or packed rows (``packing``), read from ``path`` from byte ``begin``."""

    def __init__(self, path: Path, begin: int, encode: Encode, block_size: int, packing: bool):
        super().__init__(path, begin, LineReader(path, None), lambda texts: [], block_size, packing)
        self.encode_records = encode

    def state_dict(self) -> dict[str, Any]:
        state = self._state
        return {**state, "carry": [], "pending": [{k: list(v) for k, v in row.items()} for row in state["pending"]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({**state, "pending": []})
        self._state["pending"] = [{k: [int(x) for x in v] for k, v in row.items()} for row in state["pending"]]

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        return records_read(self.path, self.end, self._state, self._rows)

    def _rows(self, texts: list[str], offsets: list[int]) -> list[dict[str, list[int]]]:
        rows = self.encode_records(texts, offsets)
        if self.packing:
            bins = best_fit_decreasing([len(row["input_ids"]) for row in rows], self.block_size)
            return [packed_row([rows[i]["input_ids"] for i in b], [rows[i]["labels"] for i in b]) for b in bins]
        return [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in rows]


def scan(stream: LineStream, index: int, count: int,
         check: Callable[[list[str], list[int]], list[Any]]) -> tuple[int, list[Any]]:
    """Part ``index`` of ``count`` of a stream's file, read once from its start (the stream's own position
    untouched): how many records it holds, and what ``check(texts, offsets)`` finds in them (its bad rows)."""
    part = copy.copy(stream)
    part.set_shard(index, count)
    found: list[Any] = []
    read = 0

    def look(texts: list[str], offsets: list[int]) -> list[Any]:
        nonlocal read
        read += len(texts)
        found.extend(check(texts, offsets))
        return []

    for _ in records_read(part.path, part.end, {"offset": part.state_dict()["offset"], "pending": []}, look):
        pass
    return read, found
