"""The prepared data loaders behind ``Accelerator.prepare`` and ``prepare_data_loader`` (whose public
names, as Accelerate has them, are in ``app/distributed/data_loader.py``).

- ``map_style``: a map-style dataset's loader: the deterministic, shardable, resumable batch sampler
  (``ShardedBatchSampler``) and ``DataLoaderShard``;
- ``iterable``: an ``IterableDataset``'s loader, dispatched from the main process or split;
- ``stream``: a ``ShardedStream``'s loader, each process reading its own part, its position checkpointed;
- ``length_grouping``: batches of similar length (``LengthGroupedSampler``);
- ``prefetch``: a host thread that loads and places the next batches while the device computes.
"""
