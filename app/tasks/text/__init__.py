"""``task=text_classification``: a Transformers encoder fine-tuned on any dataset of one or two text
columns, to one class, several classes, or a number. The nine GLUE tasks are presets of it
(``conf/task/glue_<name>.yaml``: the same schema and task with values, and ``glue.py``'s spec).

- ``config``: the schema (``TextClassificationConfig``); light, like ``glue`` (the nine specs:
  columns, labels, official metrics, TSV layouts) and ``metrics`` (the problems and their metrics by
  name), so composing a config imports no torch, transformers or datasets.
- ``sources``: the raw splits from local files, a GLUE folder or ``datasets.load_dataset``; ``tsv``:
  the GLUE TSV parser (unquoted text, one clear sentence per bad line).
- ``labels``: the columns checked, the problem and label set read from the training split, each
  split's targets encoded.
- ``tokenization``: tokenization cached on disk, keyed on everything that changes the token ids.
- ``batches``: padding rows into batches (and a row's optional second view, a swapped pair).
- ``models``: loading tokenizers and classifiers from a local folder or the hub, with checks;
  ``mean_pooling``: the mean-pooling classifier head (``task.pooling=mean``), self-contained: the
  export copies the file next to the weights.
- ``hub``: hub offline probing (a quick TCP probe instead of ~25 s of retries per file).
- ``task``: ``TextClassificationTask``, the task object the engine drives.

Adding a GLUE-like benchmark task: a spec in ``glue.py`` and a ``conf/task/<name>.yaml`` preset; any
other dataset needs no code (``task=text_classification task.data_files.train=...``).
"""
