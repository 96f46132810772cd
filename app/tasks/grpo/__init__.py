"""``task=grpo``: online reinforcement learning of a Transformers causal language model from rewards the user
writes — completions generated for each prompt with the current weights, scored by reward functions, learnt with
GRPO's clipped objective against group-relative advantages. Built on ``task=sft`` (model, tokenizer, chat
template, chunked log-probabilities) and ``task=dpo`` (the reference model options); the completion token is the
item of the engine's loss (``loss_type=dapo``).

- ``config``: the schema (``GRPOConfig``: sft's fields plus generation, rewards, advantages, objective).
- ``prompts``: the prompt rows, read and tokenized as sft reads rows (bad ones judged by ``task.bad_rows``).
- ``rewards``: ``task.rewards`` imported (or a reward model loaded), called, their outputs checked.
- ``advantages``: reward outputs checked, weighted and summed (None: no opinion), group-relative
  advantages, TRL's reward metrics.
- ``sampling``: reproducible rollouts (counter-based inverse-CDF sampling keyed by seed, step, prompt and k;
  a KV-cache generation loop over left-padded prompts, a group's prompt prefilled once).
- ``generation``: a batch of prompts completed, scored and gathered across processes (``Rollouts``).
- ``rollouts``: the generation batch kept for checkpoints, and cut into micro-batches.
- ``loss``: the per-token objective (clipped ratio, k3 KL) and its four aggregations as the engine's
  per-sample (summed loss, items), with TRL's metrics.
- ``task``: ``GRPOTask``, the engine's ``MakesTrainingBatches`` task.
"""
