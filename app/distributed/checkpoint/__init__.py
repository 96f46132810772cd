"""Checkpoints in the runtime: what a checkpoint folder holds and how it is written, verified, chosen
and read. (When to save, what to keep and what ``resume=`` means is the engine's policy,
``app/engine/checkpoint.py``.) From the bottom up:

- ``errors``: ``CheckpointError`` (bad input: one sentence, exit 2), ``DiskFullError`` and
  ``CheckpointWriteError`` (a save that failed: one sentence, exit 1).
- ``atomic``: the one atomic-write mechanism: write under a temporary name, fsync, rename into place
  (``publish``), fsync the parent. Checkpoint folders, the exported ``model/`` folder and
  ``save_model``'s files all become visible through it.
- ``staging``: how a save takes the state: by reference (synchronous), or copied off the device into
  reused host buffers (asynchronous); a staged file is a ``Pending``.
- ``format``: the files, without pickle: safetensors written from memory and hashed while fsynced,
  nested states as JSON skeleton + tensors, bounded well-formedness checks before anything is read.
- ``store``: the folders' life-cycle: ``checkpoints/checkpoint_<N>`` numbering, the manifest (sizes
  and SHA-256 of every file, written last), commit, verification, choosing the newest that verifies,
  rotation, fault points for the crash tests; and reading a named state by the manifest.
- ``layouts``: the full and the sharded layout of model and optimizer state, read in one process.
- ``io``: ``CheckpointIO``, the small protocol a backend *has* (``Backend.checkpoint_io``) to save and
  load model and optimizer state: ``FullStateIO`` (main process writes the full state) and
  ``sharded_io.ShardedStateIO`` (FSDP2: per-rank shards with torch.distributed.checkpoint).
- ``rng``: every rank's python/numpy/torch/device RNG states.
- ``background``: ``BackgroundWriter``, the one checkpoint write in flight of an asynchronous save
  (``save_state(async_save=True)``), on a thread of its own; waited for before anything else touches
  checkpoints.
- ``training_state``: ``Accelerator.save_state``/``load_state`` given the objects explicitly
  (``TrainingObjects``: models, optimizers, schedulers, loaders, registered objects, counters), and
  ``save_weights``/``load_weights``: a model's weights alone, committed the same way.
- ``best``: ``checkpoints/best_<step>/``, the weights of a best evaluation that no checkpoint holds:
  naming, listing, pruning.
- ``export``: ``Accelerator.save_model`` and the run's exported weights, as transformers writes them.

Nothing is imported here, so that the lower layers load without the upper ones.
"""
