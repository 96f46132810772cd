"""``task=reward_model``: a reward model (one-label ``AutoModelForSequenceClassification`` on a causal
language model) trained on pairs of a chosen and a rejected answer (the Bradley-Terry loss, with Llama 2's
margins and a centring term), ready to score completions (``scorer.py``). Built on ``task=dpo``'s data and
``task=sft``'s tokenizer, chat template and export; a pair is the item of the engine's loss.

- ``config``: the schema (``RewardModelConfig``: the preference tasks' data fields, plus the margin column and
  the centring).
- ``model``: the classifier on the causal LM, and the padding token its scores are read by.
- ``scores``: each sequence's score at its last real token, padded or packed.
- ``loss``: the loss and TRL's metrics per pair, from the two scores.
- ``predictions``: ``task.predict_test``'s file, every evaluation pair's two scores.
- ``scorer``: a saved reward model (this task's export, or any one-label classifier), frozen, scoring
  (prompt, completion) pairs in batches, formatted as the reward model was trained (for ``task=grpo``).
- ``task``: ``RewardModelTask``, what the engine drives.
"""
