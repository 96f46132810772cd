"""``task=kto``: Kahneman-Tversky optimisation of a Transformers causal language model on answers marked
good or bad (TRL's unpaired format: prompt, completion, label; or preference pairs, read as one good and
one bad answer each). Built on ``task=dpo``'s parts (the reference options, the data pipeline, the
sides' reading and fitting, the streamed file) and ``task=sft``'s (model, template, export).

- ``config``: the schema (``KTOConfig``: the preference fields plus the label's column, the loss and the
  desirable/undesirable weights).
- ``answers``: a row as its labelled answers, tokenized; each answer's mismatched KL sequence (its prompt
  with another answer), chosen per split or per read-ahead of a stream, never per batch.
- ``loss``: the KTO losses (``kto``, ``apo_zero_unpaired``) as pure functions, and TRL's metrics.
- ``task``: ``KTOTask``, what the engine drives; the KL estimate z over the whole optimizer step.
"""
