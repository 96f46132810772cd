"""``task=dpo``: preference tuning (DPO, IPO) of a Transformers causal language model on pairs of a
chosen and a rejected answer to a prompt. Built on ``task=sft`` (model, tokenizer, chat template and
its spans, export) and ``task=causal_lm`` (token losses); the pair is the item of the engine's loss.

- ``config``: the schema (``DPOConfig``: sft's fields plus the pair's columns, β, loss type, reference).
- ``pairs``: a row as two formatted texts (explicit or implicit prompt), tokenized, bad pairs refused.
- ``loss``: the preference losses and TRL's metrics from summed answer log-probabilities.
- ``reference``: the reference model (a frozen copy, the adapters disabled, or values precomputed once).
- ``stream``: ``task.streaming=true``, the training pairs read line by line, named by byte offset.
- ``task``: ``DPOTask``, what the engine drives.
"""
