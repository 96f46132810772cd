"""The GLUE TSV parser: a header line naming the columns, then one example per line.

GLUE's files hold literal, unbalanced ``"`` and are not quoted, so csv must not treat quotes
specially (QUOTE_NONE). A task's spec names its text and label columns; GLUE's own test files have
``index`` instead of the label column and no gold labels. Every problem is one sentence naming the
file and the line.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import ConfigError
from app.tasks.glue.config import GlueSpec

if TYPE_CHECKING:
    import datasets

UNLABELED = -1
"""Label of a row without gold label (GLUE's own test.tsv; the hub's test split)."""


def read_glue_tsv(path: Path, spec: GlueSpec) -> datasets.Dataset:
    """A GLUE-format TSV of ``spec``'s task, as a dataset with the hub's columns (texts, label, idx).

    MRPC's header is ``Quality  #1 ID  #2 ID  #1 String  #2 String``; SST-2's ``sentence  label``.
    """
    import datasets

    expected = f"a GLUE {spec.title} TSV of {spec.items}"
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # -sig: some copies start with a BOM
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(f"{path} line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x}), where {expected} "
                          "was expected.") from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise ConfigError(f"{path} line {line} holds a NUL byte (binary data?), where {expected} was expected.")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    rows: list[tuple[int, list[str]]] = []
    try:
        for row in reader:
            if row:
                rows.append((reader.line_num, row))
    except csv.Error as err:
        raise ConfigError(f"{path} line {reader.line_num + 1} cannot be read as TSV ({err}), where {expected} "
                          "was expected.") from None
    if not rows:
        raise ConfigError(f"{path} is empty, where a GLUE {spec.title} TSV with a header line was expected.")
    (_, header), body = rows[0], rows[1:]
    column = {name.strip(): i for i, name in enumerate(header)}
    if any(name not in column for name in spec.text_headers):
        named = " and ".join(repr(name) for name in spec.text_headers)
        raise ConfigError(f"{path} is not a GLUE {spec.title} TSV: its header has no {named}.")
    if not body:
        raise ConfigError(f"{path} has a header line but no {spec.items}.")
    for line_no, row in body:
        if len(row) != len(header):
            raise ConfigError(
                f"{path} line {line_no} has {len(row)} fields where the header has {len(header)}."
            )
    label_col, index_col = column.get(spec.tsv_label_header), column.get("index")
    records: dict[str, list] = {
        name: [row[column[header_name]] for _, row in body]
        for name, header_name in zip(spec.text_columns, spec.text_headers)
    }
    records["label"] = [_label(path, n, spec, row[label_col]) if label_col is not None else UNLABELED
                        for n, row in body]
    # The hub's idx is the 0-based row number; GLUE's test.tsv numbers its rows itself.
    records["idx"] = [_integer(path, n, "index", row[index_col]) if index_col is not None else i
                      for i, (n, row) in enumerate(body)]
    features = datasets.Features(
        {
            **{name: datasets.Value("string") for name in spec.text_columns},
            "label": datasets.ClassLabel(names=list(spec.label_names)),
            "idx": datasets.Value("int32"),
        }
    )
    return datasets.Dataset.from_dict(records, features=features)


def _integer(path: Path, line: int, column: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{path} line {line} has {column} {value!r} where an integer was expected.") from None


def _label(path: Path, line: int, spec: GlueSpec, value: str) -> int:
    count = len(spec.label_names)
    label = int(value) if value.strip().isdigit() else -1
    if label not in range(count):
        allowed = ", ".join(str(i) for i in range(count - 1)) + f" or {count - 1}"
        raise ConfigError(f"{path} line {line} has {spec.tsv_label_header} {value!r} where {allowed} was expected.")
    return label
