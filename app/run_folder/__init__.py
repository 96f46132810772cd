"""The run folder: what a run writes where, who may write it, and how a refused start is taken back.

- ``layout.py``: the one owner of the folder's names (``app.log``, ``.lock``, ``.hydra/*``,
  ``metrics.jsonl``, ``checkpoints/checkpoint_<N>``, a checkpoint's ``manifest.json``...) and the paths
  built from them; every layer that reads or writes a run folder asks there;
- ``claims.py``: one run per folder: the lock, a new run refused over an earlier one's results
  (``overwrite=true`` moves it aside);
- ``record.py``: Hydra's ``.hydra/`` record, read back by a resume, written late when a resume deferred it;
- ``undo.py``: a refused config leaves nothing behind (what Hydra wrote for it is taken back).

Torch-free; below the runtime, the engine and the launchers, which all use it.
"""
