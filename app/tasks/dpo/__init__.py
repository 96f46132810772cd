"""``task=dpo``: preference tuning of a Transformers causal language model on pairs of a chosen and a
rejected answer to a prompt, with any of TRL's objectives. Built on ``task=sft`` (model, tokenizer, chat
template and its spans, export) and ``task=causal_lm`` (token losses); the pair is the item of the
engine's loss. ``task=kto`` (``app/tasks/kto``) reuses these parts.

- ``config``: the schemas (``PreferenceConfig``: what preference tasks share; ``DPOConfig``: the
  objectives, their options, which need no reference and which depend on the batch).
- ``pairs``: a row as two formatted texts (explicit or implicit prompt), tokenized, bad pairs refused;
  ``fit``: a pair's sides fitted into the block.
- ``logps``: each sequence's log-probabilities from the logits (LD-DPO's weights, WPO's means, whole
  sequences' NLL); ``objectives``: the losses as one table of pure functions, and TRL's metrics.
- ``reference``: the reference model (a frozen copy or another model, the adapters disabled, or values
  precomputed once); ``preference``: ``PreferenceTask``, the data pipeline, the reference's choice and
  TR-DPO's synchronisation.
- ``packing``: pairs packed into rows; ``stream``: ``task.streaming=true``, items read line by line.
- ``task``: ``DPOTask``, what the engine drives.
"""
