"""GLUE SST-2: is a movie-review sentence positive? One sentence per example; accuracy (and binary F1).

The whole task is this description: app/tasks/glue loads the data (hub, GLUE TSV ``sentence<TAB>label``
with test ``index<TAB>sentence``, parquet/arrow, save_to_disk), tokenizes and caches it, and drives
the model (``GlueTask``). Light on purpose: config composition imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from app.tasks.glue.config import GlueConfig, GlueSpec

SST2 = GlueSpec(
    config="sst2",
    title="SST-2",
    text_columns=("sentence",),
    label_names=("negative", "positive"),
    folders=("sst2", "SST-2"),  # the hub's parquet folder; GLUE's own download
)


@dataclass
class GlueSst2Config(GlueConfig):
    spec: ClassVar[GlueSpec] = SST2
    name: str = "glue_sst2"
