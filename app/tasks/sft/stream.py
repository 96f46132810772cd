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

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from app.config import ConfigError
from app.tasks.causal_lm.stream import READ_AHEAD, LineReader, LineStream
from app.tasks.sft.packing import best_fit_decreasing, packed_row


def read_record(path: Path, line: bytes, offset: int) -> dict[str, Any] | None:
    """A JSON Lines record (None for a blank line), or one sentence naming the line's byte offset."""
    if not line.strip():
        return None
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path}: the line at byte {offset} is not a JSON record ({err}).") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path}: the line at byte {offset} is not a JSON object.")
    return record


def first_records(path: Path, count: int) -> tuple[list[dict[str, Any]], int]:
    """The file's first ``count`` records and the byte offset after them."""
    records: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        while len(records) < count:
            offset = f.tell()
            line = f.readline()
            if not line:
                break
            record = read_record(path, line, offset)
            if record is not None:
                records.append(record)
        return records, f.tell()


def read_ahead(path: Path, f: BinaryIO, end: int) -> tuple[list[dict[str, Any]], list[int]]:
    """The next ``READ_AHEAD`` records of an open file before byte ``end``, and their lines' byte offsets."""
    records: list[dict[str, Any]] = []
    offsets: list[int] = []
    while len(records) < READ_AHEAD and f.tell() < end:
        offset = f.tell()
        record = read_record(path, f.readline(), offset)
        if record is not None:
            records.append(record)
            offsets.append(offset)
    return records, offsets


def records_read(path: Path, end: int, state: dict[str, Any],
                 rows_of: Callable[[list[dict[str, Any]], list[int]], list[Any]]) -> Iterator[Any]:
    """A JSON Lines stream's rows: from its ``state``'s offset (and the rows made but not handed out), the
    records of each read-ahead made into rows by ``rows_of(records, offsets)``, until byte ``end``."""
    pending: list[Any] = state["pending"]
    with open(path, "rb") as f:
        f.seek(state["offset"])
        while True:
            while pending:
                yield pending.pop(0)  # popped first: state_dict() is then after it
            records, offsets = read_ahead(path, f, end)
            state["offset"] = f.tell()
            if not records:
                return  # the part's end
            pending.extend(rows_of(records, offsets))


Encode = Callable[[list[dict[str, Any]], list[int]], list[dict[str, list[int]]]]
"""Records and their byte offsets -> training rows (``input_ids``, ``labels``), those with nothing learnt left out."""


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

    def _rows(self, records: list[dict[str, Any]], offsets: list[int]) -> list[dict[str, list[int]]]:
        rows = self.encode_records(records, offsets)
        if self.packing:
            bins = best_fit_decreasing([len(row["input_ids"]) for row in rows], self.block_size)
            return [packed_row([rows[i]["input_ids"] for i in b], [rows[i]["labels"] for i in b]) for b in bins]
        return [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in rows]
