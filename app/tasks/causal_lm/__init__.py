"""``task=causal_lm``: a Transformers causal language model (``AutoModelForCausalLM``, pretrained or
randomly initialised from a configuration) trained on documents of text: plain text (one document
per line), JSON Lines, parquet... or a hub dataset.

- ``config``: the schema (``CausalLMConfig``); light, so composing a config imports no torch.
- ``documents``: tokenization with an EOS after each document, packing into blocks (``group_texts``),
  the map-style splits read (through ``app/tasks/text/sources.py``), held out, tokenized and cached.
- ``stream``: the training file read line by line as a stream (``task.streaming=true``), each process
  its own byte range, packed on the fly, its position (offset and packing buffer) checkpointed.
- ``batches``: rows of token ids into batches (padding and -100 labels for single documents).
- ``models``: the model from ``task.model`` or ``task.config`` (+ ``task.config_overrides``); FLOPs per token.
- ``task``: ``CausalLMTask``, the task object the engine drives; its evaluation is summed per process
  and reduced (``app.tasks.base.SummedMetrics``): ``eval/loss`` per token and ``eval/perplexity``.
"""
