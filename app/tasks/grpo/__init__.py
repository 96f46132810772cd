"""``task=grpo`` (to come): online reinforcement learning of a Transformers causal language model from
rewards the user writes — completions generated for each prompt with the current weights, scored by
reward functions, learnt with GRPO's clipped objective against group-relative advantages. Built on
``task=sft`` (model, tokenizer, chat template, chunked log-probabilities) and ``task=dpo`` (the
reference model options); the completion token is the item of the engine's loss (``loss_type=dapo``).

- ``config``: the schema (``GRPOConfig``: sft's fields plus generation, rewards, advantages, objective).
- ``advantages``: reward outputs checked, weighted and summed (None: no opinion), group-relative
  advantages, TRL's reward metrics.
- ``loss``: the per-token objective (clipped ratio, k3 KL) and its four aggregations as the engine's
  per-sample (summed loss, items), with TRL's metrics.
- ``sampling``: reproducible rollouts (counter-based Gumbel-max keyed by seed, step, prompt and k; a
  KV-cache generation loop over left-padded prompts).
"""
