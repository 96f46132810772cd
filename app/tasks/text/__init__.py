"""What every GLUE classification task shares; each task itself is one small file beside this package.

A task is described by a :class:`~app.tasks.glue.config.GlueSpec` (hub config name, text columns,
label names, TSV header names) attached to its config schema, and this package does the rest:

- ``config``: the shared schema fields (``GlueConfig``), the spec, the pooling choice. Light: no
  torch, transformers or datasets, so composing a config stays fast.
- ``sources``: the four data sources (the hub; local GLUE TSV, parquet/arrow files, a
  ``save_to_disk`` folder), each giving ``datasets.Dataset`` splits with the hub's columns, and a
  digest of their contents.
- ``tsv``: the GLUE TSV parser (unquoted text, one clear sentence per bad line).
- ``tokenization``: tokenization cached on disk, keyed on everything that changes the token ids.
- ``batches``: padding rows into batches (and a row's optional second view, e.g. a swapped pair).
- ``models``: loading tokenizers and classifiers from a local folder or the hub, with checks.
- ``hub``: hub offline probing (a quick TCP probe instead of ~25 s of retries per file).
- ``task``: ``GlueTask``, the task object the engine drives, for any spec.

Adding a GLUE task: a file ``app/tasks/glue_<name>.py`` with its schema (a ``GlueConfig`` subclass
whose ``spec`` describes the data), a ``conf/task/glue_<name>.yaml`` and one entry in
``app.tasks.TASK_SCHEMAS`` (see ``glue_sst2.py``). A task with behaviour of its own subclasses
``GlueTask`` (see ``glue_mrpc.py``: both orders of a paraphrase pair).
"""
