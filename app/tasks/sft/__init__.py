"""``task=sft``: instruction tuning of a Transformers causal language model on conversations
(``messages``), prompt/completion pairs (strings or messages) or plain text, formatted by a chat
template, the loss on the learnt tokens only. Built on ``task=causal_lm`` (model, tokenizer, export,
summed evaluation, the engine's item-normalised loss).

- ``config``: the schema (``SFTConfig``: causal_lm's fields plus format, fields, template, train_on).
- ``conversations``: a row as a conversation or plain text, bad rows refused naming file and line.
- ``templates``: the chat template (the tokenizer's, built-in ``chatml``, or a Jinja file).
- ``spans``: the learnt character ranges, found by rendering prefix by prefix (no generation markers).
- ``tokens``: tokenization with offsets into input_ids and labels, cached, rows with nothing learnt dropped.
- ``packing``: best-fit-decreasing packing with per-conversation ``position_ids``; the collator.
- ``attention``: the block-diagonal attention of packed rows (positions, or a 4-D mask), checked on the model.
- ``task``: ``SFTTask``, what the engine drives.
"""
