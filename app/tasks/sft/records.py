"""A chat task's rows as they come. JSON Lines and JSON files are read record by record, each record kept as
its own JSON text: one malformed line is one bad row (``datasets``' JSON reader refuses the whole file), and
every record keeps its own shape (an Arrow table unifies the rows' types, fills the keys a row lacks with
None, and refuses a file whose ``arguments`` are a string in one row and an object in the next). Other
sources (parquet, arrow, a ``save_to_disk`` folder, the hub) come typed from ``datasets``; their rows are
the dicts it gives, the None it filled in dropped where messages are read
(``conversations.message``).

A row's place, for messages and ``skipped_rows.jsonl``: the line of a JSON Lines file (1-based), the
index of a JSON file's record or a typed dataset's row (1-based), the byte offset of a streamed line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.config import ConfigError
from app.tasks.sft.conversations import BadRow
from app.tasks.text.sources import Split, files_fingerprint, read_file

if TYPE_CHECKING:
    import datasets

RECORD = "__record__"
"""The column that holds a record's JSON text (a name no user column has)."""
PLACE = "__place__"
"""The column that holds a record's line number (JSON Lines) or byte offset (a stream)."""
NOT_UTF8 = "\x00"
"""Starts the text kept for a line that is not UTF-8 (no JSON text starts with it): a bad row, not a
file that cannot be read."""


@dataclass(frozen=True)
class Places:
    """How a split's rows are named in messages: ``<origin> line 8``, ``<origin> row 8``, or
    ``<origin> at byte 512`` (a streamed line)."""

    origin: str
    unit: str
    """``line`` (the PLACE column holds line numbers), ``row`` (the row's index + 1) or ``byte``."""

    def where(self, place: int) -> str:
        if self.unit == "byte":
            return f"{self.origin} at byte {place}"
        return f"{self.origin} {self.unit} {place}"

    def place(self, row: dict[str, Any], index: int) -> int:
        """The row's line, byte offset or 1-based index."""
        return int(row[PLACE]) if PLACE in row else index + 1


def read_records(path_text: str, split: str, raw_cache: Path) -> tuple[Split, Places]:
    """``task.data_files.<split>``: a JSON Lines or JSON file as its records' texts; anything else as
    ``datasets`` reads it (``text.sources.read_file``)."""
    import datasets

    path = Path(path_text).expanduser()
    suffix = path.suffix.lower()
    if path.is_file() and suffix in (".jsonl", ".json"):
        texts, places = (_lines(path) if suffix == ".jsonl" else _array(path))
        if not texts:
            raise ConfigError(f"{path} holds no rows.")
        data = datasets.Dataset.from_dict({RECORD: texts, PLACE: places})
        return Split(data, files_fingerprint([path]), str(path)), Places(str(path), "line" if suffix == ".jsonl"
                                                                          else "row")
    loaded = read_file(path_text, split, raw_cache)
    return loaded, Places(loaded.origin, "row")


def records_split(texts: list[str], places: list[int], origin: str, fingerprint: str) -> Split:
    """Records already read (a stream's held-out first lines, named by byte offset) as a split."""
    import datasets

    return Split(datasets.Dataset.from_dict({RECORD: texts, PLACE: places}), fingerprint, origin)


def _lines(path: Path) -> tuple[list[str], list[int]]:
    texts, places = [], []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                texts.append(line_text(line))
                places.append(number)
    return texts, places


def line_text(line: bytes) -> str:
    """A line's text, or one marked as not UTF-8 (:data:`NOT_UTF8`)."""
    try:
        return line.decode("utf-8").strip()
    except UnicodeDecodeError:
        return NOT_UTF8 + line.decode("utf-8", errors="replace").strip()


def _array(path: Path) -> tuple[list[str], list[int]]:
    """A JSON file: a list of records (or one record); each record's text re-encoded on its own."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path} cannot be read as JSON ({err}); a file of one record per line is read line by "
                          "line (.jsonl), each bad line then one bad row.") from None
    records = value if isinstance(value, list) else [value]
    return [json.dumps(r, ensure_ascii=False) for r in records], list(range(1, len(records) + 1))


def parse_record(text: str) -> dict[str, Any]:
    """A record's JSON text as a dict; BadRow if it is not a JSON object."""
    if text.startswith(NOT_UTF8):
        raise BadRow("is not UTF-8 text")
    try:
        record = json.loads(text)
    except ValueError as err:
        raise BadRow(f"is not a JSON record ({err})") from None
    if not isinstance(record, dict):
        raise BadRow(f"is not a JSON object (it is a {type(record).__name__})")
    return record


def batch_rows(batch: dict[str, list]) -> list[dict[str, Any]]:
    """A ``datasets.map`` batch as one dict per row (still raw: :func:`row_record` reads a row)."""
    return [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]


def row_record(row: dict[str, Any]) -> dict[str, Any]:
    """The user's columns of a row: a JSON record parsed (BadRow if malformed), a typed row as it is."""
    if RECORD in row:
        return parse_record(row[RECORD])
    return row


def raw_text(row: dict[str, Any]) -> str:
    """A row as ``skipped_rows.jsonl`` keeps it: a record's own text, a typed row as JSON."""
    if RECORD in row:
        return str(row[RECORD])
    return json.dumps(row, ensure_ascii=False, default=str)


SAMPLE = 64
"""Records read to learn a file's columns (several, in case its first lines are bad)."""


def parsed(texts: list[str]) -> list[dict[str, Any]]:
    """The records among ``texts`` that are JSON objects (the bad ones left for the rows' own checks)."""
    records = []
    for text in texts:
        try:
            records.append(parse_record(text))
        except BadRow:
            continue
    return records


def sample_records(data: datasets.Dataset, count: int = SAMPLE) -> list[dict[str, Any]]:
    """A split's first records that parse: a typed dataset's first rows, a JSON file's first records."""
    head = data[:count]
    if RECORD in data.column_names:
        return parsed(head[RECORD])
    return batch_rows(head)
