"""Schema of the GLUE MRPC task, kept apart from the task so composing a config stays light."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from app.tasks.glue.config import GlueConfig, GlueSpec

MRPC = GlueSpec(
    config="mrpc",
    title="MRPC",
    text_columns=("sentence1", "sentence2"),
    label_names=("not_equivalent", "equivalent"),
    # GLUE's MRPC files: Quality  #1 ID  #2 ID  #1 String  #2 String (test: index instead of Quality).
    tsv_text_headers=("#1 String", "#2 String"),
    tsv_label_header="Quality",
    folders=("mrpc",),
)


@dataclass
class GlueMrpcConfig(GlueConfig):
    spec: ClassVar[GlueSpec] = MRPC
    name: str = "glue_mrpc"
    swap_pairs: bool = False
    """Also train on every pair in the other order (a paraphrase is one both ways): the train split
    doubles, and so does the cost of an epoch; evaluation is unchanged."""
    symmetric_eval: bool = False
    """Evaluate (and predict the test split) on each pair in both orders and average the two
    log-probabilities: a paraphrase is one both ways, so the prediction should not depend on which
    sentence comes first. Costs a second forward pass per evaluated pair; training is unchanged, and
    so is the exported model (it scores one order: average both orders yourself to get these numbers)."""
