"""The nine GLUE tasks as data descriptions: what ``task=glue_<name>`` reads and how.

Each spec says what Transformers' ``run_glue.py`` table says (the hub's text columns, the label
names, the official metrics), plus where GLUE's own download keeps its files and how they are laid
out. A GLUE preset is ``task=text_classification`` with ``task.glue=<name>`` and these values
(``conf/task/glue_<name>.yaml``); nothing else in the code is GLUE's own.

Light on purpose (no torch, transformers or datasets): config checks read it.

GLUE's TSV layouts (``glue_data/<Task>/``, as ``download_glue_data.py`` leaves them):

=======  ==================================================================  ====================
task     labeled files (train.tsv, dev.tsv): text columns -> label           test.tsv id column
=======  ==================================================================  ====================
CoLA     no header: source, label, original label, sentence (col. 3 -> 1)    index (has a header)
SST-2    sentence -> label                                                   index
MRPC     #1 String, #2 String -> Quality                                     index
STS-B    sentence1, sentence2 -> score (last column, a float 0-5)            index
QQP      question1, question2 -> is_duplicate                                id
MNLI     sentence1, sentence2 -> gold_label (a name; dev_matched.tsv and     index
         dev_mismatched.tsv; test_matched.tsv)
QNLI     question, sentence -> label (a name)                                index
RTE      sentence1, sentence2 -> label (a name)                              index
WNLI     sentence1, sentence2 -> label (0/1)                                 index
=======  ==================================================================  ====================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GlueName(enum.Enum):
    """The ``task.glue`` values: GLUE's tasks by the hub's config names."""

    cola = "cola"
    sst2 = "sst2"
    mrpc = "mrpc"
    stsb = "stsb"
    qqp = "qqp"
    mnli = "mnli"
    qnli = "qnli"
    rte = "rte"
    wnli = "wnli"


class TsvLabels(enum.Enum):
    """How a GLUE TSV writes its labels (and so how test predictions are written back)."""

    ids = "ids"
    """0, 1, ...: the index of the label name."""
    names = "names"
    """The label name itself (``entailment``)."""
    scores = "scores"
    """A number (STS-B's similarity, 0-5)."""


@dataclass(frozen=True)
class TsvLayout:
    """Where one kind of GLUE TSV file keeps its columns."""

    text: tuple[str | int, ...]
    """The text columns, by header name (or by position when the file has no header), in the
    order of the spec's ``text_columns``."""
    label: str | int | None
    """The label column (None: the file has none, GLUE's test files)."""
    index: str | None = None
    """The column numbering the rows (a test file's submission ids); None: the row number."""
    header: bool = True


@dataclass(frozen=True)
class GlueSpec:
    """One GLUE task: its hub columns and labels, its official metrics and its TSV layout."""

    name: GlueName
    title: str
    """The task's name in messages and progress bars (``MRPC``)."""
    text_columns: tuple[str, ...]
    """The hub's text columns, in the order the tokenizer takes them: one sentence or a pair."""
    label_names: tuple[str, ...] | None
    """Names of labels 0, 1, ... (None: a regression task, STS-B)."""
    metrics: tuple[str, ...]
    """The official metrics (``task.metrics`` of the preset)."""
    labeled: TsvLayout
    """train.tsv and dev.tsv."""
    test: TsvLayout
    """test.tsv (no label column)."""
    tsv_labels: TsvLabels = TsvLabels.ids
    folder: str = ""
    """GLUE's own folder name for the task (``glue_data/MRPC``); ``task.data_dir`` may point at it,
    at ``glue_data`` itself, or at a folder named after the hub config (``mrpc/``)."""
    eval_splits: tuple[str, ...] = ("validation",)
    """The evaluation splits: the first is the main one; each further one is reported with its
    suffix (``extra_eval``: MNLI's ``validation_mismatched`` as ``mm``)."""
    test_split: str = "test"

    @property
    def config(self) -> str:
        """The hub dataset's config name (``mrpc``)."""
        return self.name.value

    @property
    def preset(self) -> str:
        """The preset's task name (``task=glue_mrpc``)."""
        return f"glue_{self.config}"

    @property
    def folders(self) -> tuple[str, ...]:
        """Subfolders of ``task.data_dir`` also searched for the files (after the folder itself)."""
        return (self.config, self.folder)

    @property
    def eval_suffixes(self) -> dict[str, str]:
        """Evaluation split -> metric suffix ("" for the main one)."""
        return {split: EVAL_SUFFIXES.get(split, split) if i else "" for i, split in enumerate(self.eval_splits)}

    def tsv_names(self, split: str) -> tuple[str, ...]:
        """The file names a split may have in GLUE's download (or as the hub names the split)."""
        glue_names = {"validation": ("dev.tsv",), "validation_matched": ("dev_matched.tsv",),
                      "validation_mismatched": ("dev_mismatched.tsv",)}
        return (f"{split}.tsv", *glue_names.get(split, ()))


EVAL_SUFFIXES = {"validation_mismatched": "mm"}
"""The metric suffix of a further evaluation split, where it is not the split's name."""

_PAIR = ("sentence1", "sentence2")


def _indexed(text: tuple[str | int, ...], label: str | int | None, index: str = "index") -> tuple[TsvLayout, TsvLayout]:
    """A labeled layout and its test file's (same text columns, an id column, no label)."""
    return TsvLayout(text=text, label=label), TsvLayout(text=text, label=None, index=index)


GLUE_SPECS: dict[GlueName, GlueSpec] = {
    spec.name: spec
    for spec in (
        GlueSpec(GlueName.cola, "CoLA", ("sentence",), ("unacceptable", "acceptable"), ("matthews_corrcoef",),
                 labeled=TsvLayout(text=(3,), label=1, header=False),
                 test=TsvLayout(text=("sentence",), label=None, index="index"), folder="CoLA"),
        GlueSpec(GlueName.sst2, "SST-2", ("sentence",), ("negative", "positive"), ("accuracy",),
                 *_indexed(("sentence",), "label"), folder="SST-2"),
        GlueSpec(GlueName.mrpc, "MRPC", _PAIR, ("not_equivalent", "equivalent"), ("accuracy", "f1"),
                 *_indexed(("#1 String", "#2 String"), "Quality"), folder="MRPC"),
        GlueSpec(GlueName.stsb, "STS-B", _PAIR, None, ("pearson", "spearman"),
                 *_indexed(_PAIR, "score"), tsv_labels=TsvLabels.scores, folder="STS-B"),
        GlueSpec(GlueName.qqp, "QQP", ("question1", "question2"), ("not_duplicate", "duplicate"), ("accuracy", "f1"),
                 *_indexed(("question1", "question2"), "is_duplicate", index="id"), folder="QQP"),
        GlueSpec(GlueName.mnli, "MNLI", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
                 ("accuracy",), *_indexed(_PAIR, "gold_label"), tsv_labels=TsvLabels.names, folder="MNLI",
                 eval_splits=("validation_matched", "validation_mismatched"), test_split="test_matched"),
        GlueSpec(GlueName.qnli, "QNLI", ("question", "sentence"), ("entailment", "not_entailment"), ("accuracy",),
                 *_indexed(("question", "sentence"), "label"), tsv_labels=TsvLabels.names, folder="QNLI"),
        GlueSpec(GlueName.rte, "RTE", _PAIR, ("entailment", "not_entailment"), ("accuracy",),
                 *_indexed(_PAIR, "label"), tsv_labels=TsvLabels.names, folder="RTE"),
        GlueSpec(GlueName.wnli, "WNLI", _PAIR, ("not_entailment", "entailment"), ("accuracy",),
                 *_indexed(_PAIR, "label"), folder="WNLI"),
    )
}
