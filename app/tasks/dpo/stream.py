"""``task.streaming=true`` for ``task=dpo``: the training JSON Lines file read line by line while training
(never loaded whole), each process its own byte range (``causal_lm/stream.py``'s ``LineStream``: the
parts, the seeking, the checks on resume), each record made into a pair as the map-style rows are
(``pairs.encode_pairs``: cut to fit, or left out with ``task.overlong=drop``), a bad pair refused naming
its byte offset.

A streamed pair is named by the byte offset of its line (``pair``): the key of its row in
``task.reference=precomputed``'s table (``reference.Precomputed``), which a stream that seeks can find
again without counting lines. Evaluation pairs (map-style) are named -1, -2, …: never an offset.

What a checkpoint saves: the byte offset after the last line read and the pairs already made but not
yet handed out; a resumed run seeks there and goes on exactly, reading nothing before it again.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from app.tasks.causal_lm.stream import LineReader, LineStream
from app.tasks.dpo.pairs import COUNTS
from app.tasks.sft.records import PLACE, RECORD
from app.tasks.sft.stream import records_read

BOOKKEEPING = (*COUNTS, "error", "place", "raw")
"""The columns of ``encode_pairs`` that are not a pair's own (a reward model's ``margin`` is)."""

RowsOf = Callable[[list[str], list[int]], list[dict[str, Any]]]
"""A read-ahead's records (their lines' texts) and their byte offsets -> the items they make."""


class PairStream(LineStream):
    """Items of two token rows each (task=dpo: ``chosen_ids``, ``chosen_labels``, ``rejected_ids``,
    ``rejected_labels``, ``pair``: the line's byte offset; ``rows_of`` makes them from a read-ahead's
    records) read from ``path`` from byte ``begin``: an ``app.distributed.data.stream.ShardedStream``."""

    def __init__(self, path: Path, begin: int, rows_of: RowsOf, block_size: int):
        super().__init__(path, begin, LineReader(path, None), lambda texts: [], block_size, False)
        self.rows_of = rows_of

    def state_dict(self) -> dict[str, Any]:
        state = self._state
        return {**state, "carry": [], "pending": [{k: copy.copy(v) for k, v in row.items()} for row in state["pending"]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({**state, "pending": []})
        self._state["pending"] = [{k: ([int(x) for x in v] if isinstance(v, list) else v if isinstance(v, float)
                                       else int(v)) for k, v in row.items()} for row in state["pending"]]

    def from_the_start(self) -> PairStream:
        """A second reader of this process's part, from its beginning (this one's position untouched)."""
        clone = copy.copy(self)
        clone.set_shard(*self.shard)
        return clone

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return records_read(self.path, self.end, self._state, self.rows_of)


def stream_pairs(texts: list[str], offsets: list[int], encode: Callable[..., dict[str, list]]) -> list[dict[str, Any]]:
    """The records' pairs (``encode``: ``pairs.encode_pairs`` with the run's tokenizer and fields); bad ones
    (found and judged before training: ``SFTTask._check_stream``) and dropped ones left out."""
    out = encode({RECORD: texts, PLACE: offsets}, list(range(len(texts))))
    own = [c for c in out if c not in BOOKKEEPING]  # the sides' tokens, and a reward model's margin
    return [{**{c: out[c][k] for c in own}, "pair": offsets[k]} for k in range(len(texts))
            if not out["dropped"][k] and not out["error"][k]]
