"""The parts of ``Accelerator`` (``app/distributed/accelerator.py``, the public class), one job a module;
each is a mixin the Accelerator inherits, so its methods are the Accelerator's own (no call in between):

- ``fields``: what an Accelerator holds (declared once, assigned by its constructor);
- ``prepare``: ``prepare`` and its per-kind verbs, ``unwrap_model``, ``skip_first_batches``;
- ``training_step``: ``backward``, ``accumulate``, ``no_sync``, ``join_uneven_inputs``, ``autocast``,
  unscaling and clipping; ``step_items``: the item-normalised backward's bookkeeping;
- ``collectives``: ``gather_for_metrics``, ``gather``, ``reduce``, ``broadcast``..., ``step_flag``, ``read_async``;
- ``saving``: ``save_state``/``load_state``, ``save_weights``/``load_weights``, ``save_model``/``load_model``, ``save``;
- ``process``: where a process stands and what it runs (``wait_for_everyone``, ``main_process_first``,
  ``split_between_processes``...), shared with ``PartialState``.
"""
