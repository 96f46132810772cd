"""The GLUE TSV parser: one example per line, in the layout of one GLUE task's files.

GLUE's files hold literal, unbalanced ``"`` and are not quoted, so csv must not treat quotes
specially (QUOTE_NONE). Most files name their columns in a header line; CoLA's labeled files have
none (its columns are found by position). Test files have no gold labels, and an id column
(``index``; QQP's ``id``) that GLUE's submission format refers to. Every problem is one sentence
naming the file and the line.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import ConfigError
from app.tasks.text.glue import GlueSpec, TsvLabels, TsvLayout

if TYPE_CHECKING:
    import datasets

UNLABELED = -1
"""Label of a row without gold label (GLUE's own test.tsv; the hub's test split)."""


def read_glue_tsv(path: Path, spec: GlueSpec, layout: TsvLayout | None = None) -> datasets.Dataset:
    """A GLUE-format TSV of ``spec``'s task as a dataset with the hub's columns (texts, label, idx).

    ``layout``: the labeled files' (default) or the test file's. The label is the hub's: a
    ``ClassLabel`` of the spec's names (-1 where the file has none), or STS-B's float score (NaN).
    """
    import datasets

    layout = layout or spec.labeled
    items = "sentence pairs" if len(spec.text_columns) == 2 else "sentences"
    expected = f"a GLUE {spec.title} TSV of {items}"
    rows = _rows(path, expected)
    if not rows:
        raise ConfigError(f"{path} is empty, where {expected} was expected.")
    if layout.header:
        (_, header), body = rows[0], rows[1:]
        column = {name.strip(): i for i, name in enumerate(header)}
        names = [str(c) for c in layout.text]
        if any(name not in column for name in names):
            named = " and ".join(repr(name) for name in names)
            raise ConfigError(f"{path} is not a GLUE {spec.title} TSV: its header has no {named}.")
        if not body:
            raise ConfigError(f"{path} has a header line but no {items}.")
        for line_no, row in body:
            if len(row) != len(header):
                raise ConfigError(f"{path} line {line_no} has {len(row)} fields where the header has {len(header)}.")
        text_at = [column[name] for name in names]
        label_name = str(layout.label) if layout.label is not None else "label"
        label_at = column.get(label_name)
        index_at = column.get(layout.index) if layout.index is not None else None
    else:  # positions (CoLA: source, label, original label, sentence)
        body = rows
        width = 1 + max(int(c) for c in (*layout.text, layout.label if layout.label is not None else 0))
        for line_no, row in body:
            if len(row) < width:
                raise ConfigError(f"{path} line {line_no} has {len(row)} fields where {width} were expected.")
        text_at = [int(c) for c in layout.text]
        label_name = "label"
        label_at = int(layout.label) if layout.label is not None else None
        index_at = None
    records: dict[str, list] = {name: [row[i] for _, row in body] for name, i in zip(spec.text_columns, text_at)}
    records["label"] = [_label(path, n, spec, label_name, row[label_at]) if label_at is not None else _unlabeled(spec)
                        for n, row in body]
    # The hub's idx is the 0-based row number; GLUE's test.tsv numbers its rows itself.
    records["idx"] = [_integer(path, n, layout.index or "index", row[index_at]) if index_at is not None else i
                      for i, (n, row) in enumerate(body)]
    label_feature = (datasets.Value("float32") if spec.label_names is None
                     else datasets.ClassLabel(names=list(spec.label_names)))
    features = datasets.Features({**{name: datasets.Value("string") for name in spec.text_columns},
                                  "label": label_feature, "idx": datasets.Value("int32")})
    return datasets.Dataset.from_dict(records, features=features)


def _rows(path: Path, expected: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of each non-empty line."""
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
    return rows


def _unlabeled(spec: GlueSpec) -> float:
    return float("nan") if spec.label_names is None else UNLABELED


def _integer(path: Path, line: int, column: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{path} line {line} has {column} {value!r} where an integer was expected.") from None


def _label(path: Path, line: int, spec: GlueSpec, column: str, value: str) -> int | float:
    value = value.strip()
    if spec.tsv_labels is TsvLabels.scores:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{path} line {line} has {column} {value!r} where a number was expected.") from None
    names = spec.label_names or ()
    allowed = [str(i) for i in range(len(names))] if spec.tsv_labels is TsvLabels.ids else list(names)
    if value not in allowed:
        listed = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
        raise ConfigError(f"{path} line {line} has {column} {value!r} where {listed} was expected.")
    return allowed.index(value)
