"""``task=digits`` (the default): scikit-learn's bundled 8x8 handwritten digits, an MLP, accuracy and
macro-F1, offline on a fresh machine.

- ``config``: the schema (``DigitsConfig``); light, so composing a config imports no torch.
- ``data``: the bundled CSV read without importing scikit-learn (1.2 s of start-up saved).
- ``task``: ``DigitsTask``, the task object the engine drives (the model, its batches and metrics).
"""
