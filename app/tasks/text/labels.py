"""From a split's columns to what the model learns: which problem, which classes, which targets.

- :func:`check_columns`: the text and label columns exist (else the columns that do are listed),
  the texts are text, no split is empty;
- :func:`read_labels`: the problem (``task.problem``, or the label column's type: floats are a
  regression, lists a multi-label problem) and the label set, read from the training split: the
  dataset's own class names when it has them (a ``ClassLabel``: the hub, GLUE's files), a GLUE
  preset's fixed names, else the sorted set of its values, so every process and every resume sees
  the same ids;
- :func:`encode_labels`: each split's targets as the model's (a class id, a number, or one 0/1 per
  class), refusing an evaluation label the training split does not have, in one sentence naming it
  and the file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.config import ConfigError
from app.tasks.text.metrics import Problem

if TYPE_CHECKING:
    import datasets

    from app.tasks.text.sources import Split

LABEL_COLUMN = "__label__"
"""The encoded target beside the text columns, before tokenization (a name no dataset uses)."""
UNLABELED = -1
"""A single_label row without gold label (a test split): cross-entropy skips it (as -100)."""


@dataclass(frozen=True)
class LabelSet:
    """The problem and its classes, fixed by the training split."""

    problem: Problem
    names: tuple[str, ...]
    """Class names by id (regression: the label column's name): the export's ``id2label``."""
    spellings: tuple[Any, ...] = ()
    """Each class as the data writes it (``"yes"``, ``3``): how test predictions are written."""

    @property
    def num_outputs(self) -> int:
        return 1 if self.problem is Problem.regression else len(self.names)

    def state_dict(self) -> dict[str, Any]:
        return {"problem": self.problem.value, "labels": list(self.names)}


def _kind(feature: Any) -> str:
    """class, list, float, int, bool, string or other."""
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return "class"
    if isinstance(feature, (datasets.List, datasets.LargeList)):
        return "list"
    if isinstance(feature, datasets.Value):
        dtype = feature.dtype
        if dtype.startswith("float") or dtype == "double":
            return "float"
        if dtype.startswith(("int", "uint")):
            return "int"
        if dtype == "bool":
            return "bool"
        if dtype in ("string", "large_string"):
            return "string"
    return "other"


def _element_feature(feature: Any) -> Any:
    return getattr(feature, "feature", None)


def check_columns(split: Split, text_fields: Sequence[str], label_field: str | None) -> None:
    """The columns the task reads exist and hold what they should; the split has rows."""
    data = split.data
    columns = list(data.column_names)
    for name, key in [*((f, "text_fields") for f in text_fields), *([(label_field, "label_field")] if label_field else [])]:
        if name not in columns:
            raise ConfigError(f"{split.origin} has no column {name!r} (task.{key}); its columns are "
                              f"{', '.join(columns)}.")
    if len(data) == 0:
        raise ConfigError(f"{split.origin} holds no rows.")
    for name in text_fields:
        if _kind(data.features[name]) != "string":
            raise ConfigError(f"column {name!r} of {split.origin} (task.text_fields) holds {_describe(data.features[name])}, "
                              "not text.")
        row = _first_null(data, name)
        if row is not None:
            raise ConfigError(f"{split.origin} row {row + 1} has no text in column {name!r} (task.text_fields).")


def read_labels(train: Split, label_field: str, problem: Problem | None, fixed_names: Sequence[str] | None) -> LabelSet:
    """The problem and the label set of the training split (see the module's docstring)."""
    feature = train.data.features[label_field]
    kind = _kind(feature)
    where = f"column {label_field!r} of {train.origin} (task.label_field)"
    values = train.data[label_field]
    if problem is None:
        problem = {"list": Problem.multi_label, "float": Problem.regression}.get(kind, Problem.single_label)
    if problem is Problem.regression:
        if kind not in ("float", "int", "bool"):
            raise ConfigError(f"{where} holds {_describe(feature)}, where task.problem=regression needs numbers.")
        return LabelSet(problem, (label_field,))
    if problem is Problem.multi_label:
        if kind != "list":
            raise ConfigError(f"{where} holds {_describe(feature)}, where task.problem=multi_label needs a list of "
                              "labels per row (a JSON list, a parquet list column).")
        element = _element_feature(feature)
        if _kind(element) == "class":
            return LabelSet(problem, tuple(element.names), tuple(element.names))
        found = sorted({v for row in values if row is not None for v in row})
        return LabelSet(problem, tuple(str(v) for v in found), tuple(found))
    if kind == "float":
        fractional = next((v for v in values if v is not None and not float(v).is_integer()), None)
        if fractional is not None:
            raise ConfigError(f"{where} holds floats such as {fractional}, not classes; set task.problem=regression "
                              "(or leave it unset), or give integer or string labels.")
    elif kind not in ("class", "int", "bool", "string"):
        raise ConfigError(f"{where} holds {_describe(feature)}, which are not classes.")
    if kind == "class":
        names: tuple[str, ...] = tuple(feature.names)
        spellings: tuple[Any, ...] = names
    elif fixed_names is not None:  # a GLUE preset on other files: ids or names of its labels
        names = spellings = tuple(fixed_names)
    else:
        found_values = sorted({int(v) if kind == "float" else v for v in values if v is not None})
        names, spellings = tuple(str(v) for v in found_values), tuple(found_values)
    seen = {v for v in values if v is not None and v != UNLABELED} if kind == "class" else None
    if len(names) < 2 or (seen is not None and len(seen) < 2):
        only = names[next(iter(seen))] if seen else (names[0] if names else "none")
        raise ConfigError(f"{where} holds one class only ({only!r}); a classifier needs two or more.")
    return LabelSet(problem, names, spellings)


def encode_labels(split: Split, labels: LabelSet, label_field: str | None, train_origin: str) -> list[Any]:
    """The split's targets, one per row: a class id, a float, or one 0.0/1.0 per class. ``label_field``
    None: an unlabeled split (a test file), whose targets are placeholders."""
    n = len(split.data)
    problem = labels.problem
    if label_field is None:
        if problem is Problem.single_label:
            return [UNLABELED] * n
        if problem is Problem.regression:
            return [math.nan] * n
        return [[0.0] * len(labels.names)] * n
    feature = split.data.features[label_field]
    values = split.data[label_field]
    kind = _kind(feature)
    if problem is Problem.regression:
        if kind not in ("float", "int", "bool"):
            raise ConfigError(f"column {label_field!r} of {split.origin} holds {_describe(feature)}, where numbers "
                              "were expected.")
        for row, value in enumerate(values):
            if value is None or (isinstance(value, float) and math.isnan(value)):
                raise ConfigError(f"{split.origin} row {row + 1} has no label in column {label_field!r}.")
        return [float(v) for v in values]
    lookup = _lookup(labels, feature)
    if problem is Problem.multi_label:
        if kind != "list":
            raise ConfigError(f"column {label_field!r} of {split.origin} holds {_describe(feature)}, where lists of "
                              "labels were expected.")
        encoded = []
        for row, value in enumerate(values):
            if value is None:
                raise ConfigError(f"{split.origin} row {row + 1} has no label list in column {label_field!r}.")
            hot = [0.0] * len(labels.names)
            for item in value:
                hot[_class_id(lookup, item, split, row, labels, train_origin)] = 1.0
            encoded.append(hot)
        return encoded
    if kind == "float":
        values = [int(v) if v is not None and float(v).is_integer() else v for v in values]
    ids = []
    for row, value in enumerate(values):
        if value is None or (kind == "class" and value == UNLABELED):
            raise ConfigError(f"{split.origin} row {row + 1} has no label in column {label_field!r}.")
        ids.append(_class_id(lookup, value, split, row, labels, train_origin))
    return ids


def _lookup(labels: LabelSet, feature: Any) -> dict[Any, int]:
    """Value as stored -> class id."""
    element = _element_feature(feature) if labels.problem is Problem.multi_label else feature
    if _kind(element) == "class":
        # Stored as ids of the column's own names; the label set may order them differently.
        return {i: labels.names.index(name) for i, name in enumerate(element.names) if name in labels.names}
    lookup = {spelling: i for i, spelling in enumerate(labels.spellings)}
    if _kind(element) in ("int", "float") and all(isinstance(s, str) for s in labels.spellings):
        lookup.update({i: i for i in range(len(labels.names))})  # fixed names (a GLUE preset): ids
    return lookup


def _class_id(lookup: dict[Any, int], value: Any, split: Split, row: int, labels: LabelSet, train_origin: str) -> int:
    found = lookup.get(value)
    if found is None:
        known = ", ".join(labels.names)
        raise ConfigError(f"{split.origin} row {row + 1} has the label {value!r}, which the training data "
                          f"({train_origin}) does not have (its labels: {known}).")
    return found


def _describe(feature: Any) -> str:
    kind = _kind(feature)
    if kind == "other" or kind == "list":
        return f"{type(feature).__name__} values"
    dtype = getattr(feature, "dtype", kind)
    return {"class": "class labels", "string": "text"}.get(kind, f"{dtype} values")


def _first_null(data: datasets.Dataset, column: str) -> int | None:
    chunked = data.data.column(column)
    if chunked.null_count == 0:
        return None
    import pyarrow.compute as pc

    return int(pc.index(pc.is_null(chunked), True).as_py())
