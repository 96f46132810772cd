"""The training file read as a stream (``task.streaming=true``): a plain text or JSON Lines file, line
by line, never loaded whole; each process reads its own byte range and packs it on the fly.

Parts. The file (after the documents held out for evaluation) is cut into ``count`` equal byte
ranges; a line belongs to the range its first byte is in, so every document is read by exactly one
process, once. Position. What a checkpoint saves (``state_dict``) is the byte offset after the last
line read, the packing buffer (the tokens of an unfinished block) and the blocks already made but
not yet handed out; a resumed run seeks to that offset (``load_state_dict``) and goes on exactly
where the interrupted one was, without reading anything before it again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

from app.config import ConfigError
from app.tasks.causal_lm.documents import pack

READ_AHEAD = 64
"""Documents read and tokenized together (one tokenizer call): at most these, as blocks, wait in the state."""


class LineReader:
    """A line's document text: the line itself (plain text) or a JSON Lines record's ``field``; None
    for a blank line (no document)."""

    def __init__(self, path: Path, field: str | None):
        self.path, self.field = path, field

    def __call__(self, line: bytes, offset: int) -> str | None:
        if not line.strip():
            return None
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{self.path}: the line at byte {offset} is not UTF-8 text.") from None
        if self.field is None:
            return text.rstrip("\r\n")
        try:
            record = json.loads(text)
        except ValueError as err:
            raise ConfigError(f"{self.path}: the line at byte {offset} is not a JSON record ({err}).") from None
        if not isinstance(record, dict) or not isinstance(record.get(self.field), str):
            raise ConfigError(f"{self.path}: the record at byte {offset} has no text {self.field!r} (set "
                              "task.text_field to the key holding the text).")
        return str(record[self.field])


def first_documents(path: Path, reader: LineReader, count: int) -> tuple[list[str], int]:
    """The file's first ``count`` documents and the byte offset after them (where a stream of the
    rest starts); fewer when the file has fewer."""
    texts: list[str] = []
    with open(path, "rb") as f:
        while len(texts) < count:
            offset = f.tell()
            line = f.readline()
            if not line:
                break
            text = reader(line, offset)
            if text is not None:
                texts.append(text)
        return texts, f.tell()


class LineStream(IterableDataset):
    """Token blocks (``packing``) or one row per document, read from ``path`` starting at byte ``begin``:
    an ``app.distributed.data.stream.ShardedStream``. ``encode`` turns documents into token ids
    (``documents.encode_documents`` with the task's tokenizer)."""

    def __init__(self, path: Path, begin: int, reader: LineReader, encode: Callable[[list[str]], list[list[int]]],
                 block_size: int, packing: bool):
        self.path, self.begin, self.size = path, begin, os.path.getsize(path)
        self.reader, self.encode, self.block_size, self.packing = reader, encode, block_size, packing
        self.set_shard(0, 1)

    def set_shard(self, index: int, count: int) -> None:
        span = self.size - self.begin
        self.shard = [index, count]
        self.end = self.begin + span * (index + 1) // count
        start = self.begin + span * index // count
        self._state: dict[str, Any] = {"offset": self._line_start(start), "carry": [], "pending": [],
                                       "file_size": self.size, "shard": list(self.shard)}

    def _line_start(self, at: int) -> int:
        """The first line that begins at or after byte ``at`` (a line straddling ``at`` is the previous part's)."""
        if at == self.begin:
            return at
        with open(self.path, "rb") as f:
            f.seek(at - 1)
            if f.read(1) == b"\n":
                return at
            f.readline()
            return f.tell()

    def state_dict(self) -> dict[str, Any]:
        state = self._state
        return {**state, "carry": list(state["carry"]), "pending": [list(b) for b in state["pending"]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["file_size"]) != self.size:
            raise ConfigError(f"{self.path} has changed since this position in it was saved ({state['file_size']} "
                              f"bytes then, {self.size} now): a streamed run resumes on the file it was reading.")
        if list(state["shard"]) != self.shard:
            raise ValueError(f"this position is in part {state['shard'][0]} of {state['shard'][1]} of the stream, "
                             f"and this process reads part {self.shard[0]} of {self.shard[1]}.")
        self._state = {**state, "offset": int(state["offset"]), "carry": list(state["carry"]),
                       "pending": [list(b) for b in state["pending"]]}

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        state = self._state
        pending: list[list[int]] = state["pending"]
        with open(self.path, "rb") as f:
            f.seek(state["offset"])
            while True:
                while pending:
                    yield {"input_ids": pending.pop(0)}  # popped first: state_dict() is then after it
                texts: list[str] = []
                while len(texts) < READ_AHEAD and f.tell() < self.end:
                    offset = f.tell()
                    text = self.reader(f.readline(), offset)
                    if text is not None:
                        texts.append(text)
                state["offset"] = f.tell()
                if not texts:
                    return  # the part's end; an unfinished block is not used
                documents = self.encode(texts)
                if self.packing:
                    blocks, state["carry"] = pack(state["carry"], documents, self.block_size)
                else:
                    blocks = [ids[:self.block_size] for ids in documents]
                pending.extend(blocks)
