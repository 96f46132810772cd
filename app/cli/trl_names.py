"""TRL's and Transformers' ``TrainingArguments`` option names, each with ours: what an unknown key that
is one of them gets in its sentence (``learning_rate`` -> ``optim.lr``), instead of a "did you mean"
from spelling alone (``per_device_train_batch_size`` is not ``eval_batch_size``). Torch-free.

The table covers every option of ``TrainingArguments`` (transformers 5) and of TRL 1.16's ``SFTConfig``,
``DPOConfig``, ``GRPOConfig`` and ``RewardConfig`` (tests/test_trl_names.py reads them), plus a few older
names users still type (``max_seq_length``, ``evaluation_strategy``, ``warmup_ratio``);
docs/coming-from-trl.md gives the same answers with a word on each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Counterpart:
    """What ours is for one of TRL's options: ``key`` (a key, ``optim.lr``, or a group's option,
    ``precision=bf16``), else what happens instead (``note``), else nothing yet (both empty)."""

    key: str = ""
    note: str = ""

    def sentence(self, name: str, where: str = "", see: str = "") -> str:
        """``TRL's learning_rate is optim.lr here`` (the words after the unknown key); ``where``: the tasks
        that have the key, when the run's task does not (``task=dpo``); ``see``: a page to read."""
        if self.key:
            notes = "; ".join(note for note in (where, self.note, see) if note)
            return f"TRL's {name} is {self.key} here" + (f" ({notes})" if notes else "")
        if self.note:
            return f"TRL's {name} has no key here: {self.note}" + (f" ({see})" if see else "")
        return f"TRL's {name} has no counterpart here yet" + (f" ({see})" if see else "")


NOT_YET = Counterpart()


def _ours(key: str, note: str = "") -> Counterpart:
    return Counterpart(key, note)


def _instead(note: str) -> Counterpart:
    return Counterpart("", note)


_TRAINING_ARGUMENTS: dict[str, Counterpart] = {
    "output_dir": _ours("hydra.run.dir"),
    "do_train": _instead("python -m app trains (mode=train)"),
    "do_eval": _ours("mode=eval", "with resume=<run folder, checkpoint or model folder>"),
    "do_predict": _ours("task.predict_test", "text classification, with mode=eval or after training"),
    "learning_rate": _ours("optim.lr"),
    "weight_decay": _ours("optim.weight_decay"),
    "adam_beta1": _ours("optim.betas", "[beta1, beta2]"),
    "adam_beta2": _ours("optim.betas", "[beta1, beta2]"),
    "adam_epsilon": _ours("optim.eps"),
    "optim": _ours("optim=adamw", "or optim=sgd"),
    "optim_args": _ours("optim.<key>", "each argument its own key"),
    "optim_target_modules": NOT_YET,
    "max_grad_norm": _ours("trainer.max_grad_norm"),
    "num_train_epochs": _ours("trainer.max_epochs"),
    "max_steps": _ours("trainer.max_steps"),
    "per_device_train_batch_size": _ours("trainer.batch_size"),
    "per_device_eval_batch_size": _ours("trainer.eval_batch_size"),
    "gradient_accumulation_steps": _ours("trainer.gradient_accumulation_steps"),
    "auto_find_batch_size": NOT_YET,
    "lr_scheduler_type": _ours("scheduler=linear", "or cosine, constant"),
    "lr_scheduler_kwargs": _ours("scheduler.<key>", "each argument its own key"),
    "warmup_steps": _ours("scheduler.warmup_steps", "a ratio: scheduler.warmup_ratio"),
    "warmup_ratio": _ours("scheduler.warmup_ratio"),
    "gradient_checkpointing": _ours("trainer.gradient_checkpointing"),
    "gradient_checkpointing_kwargs": NOT_YET,
    "activation_checkpointing": _ours("trainer.gradient_checkpointing"),
    "activation_checkpointing_kwargs": NOT_YET,
    "bf16": _ours("precision=bf16"),
    "fp16": _ours("precision=fp16"),
    "bf16_full_eval": _instead("evaluation runs in the training precision"),
    "fp16_full_eval": _instead("evaluation runs in the training precision"),
    "tf32": NOT_YET,
    "torch_compile": _ours("trainer.compile"),
    "torch_compile_backend": NOT_YET,
    "torch_compile_mode": NOT_YET,
    "full_determinism": _ours("trainer.deterministic"),
    "seed": _ours("seed"),
    "data_seed": _ours("seed", "one seed draws the weights and the data order"),
    "eval_strategy": _ours("trainer.eval_every_n_steps", "null: at the end of every epoch"),
    "evaluation_strategy": _ours("trainer.eval_every_n_steps", "null: at the end of every epoch"),
    "eval_steps": _ours("trainer.eval_every_n_steps"),
    "eval_delay": NOT_YET,
    "eval_on_start": NOT_YET,
    "eval_accumulation_steps": _instead("evaluation metrics are summed batch by batch, never held whole"),
    "eval_do_concat_batches": _instead("evaluation metrics are summed batch by batch, never held whole"),
    "eval_use_gather_object": NOT_YET,
    "batch_eval_metrics": _instead("evaluation metrics are summed batch by batch, never held whole"),
    "include_for_metrics": NOT_YET,
    "prediction_loss_only": NOT_YET,
    "logging_steps": _ours("trainer.log_every_n_steps"),
    "logging_strategy": _ours("trainer.log_every_n_steps"),
    "logging_first_step": NOT_YET,
    "logging_nan_inf_filter": _instead("a NaN or infinite loss stops the run (early_stopping.stop_on_nan)"),
    "log_level": NOT_YET,
    "log_level_replica": NOT_YET,
    "log_on_each_node": NOT_YET,
    "disable_tqdm": _ours("logging.progress_bar", "false: no bar"),
    "report_to": _ours("logging.trackers"),
    "project": _ours("logging.project_name"),
    "run_name": _instead("the run is named by its folder, hydra.run.dir"),
    "trackio_space_id": NOT_YET,
    "trackio_bucket_id": NOT_YET,
    "trackio_static_space_id": NOT_YET,
    "save_strategy": _ours("checkpoint.every_n_steps", "or checkpoint.every_epoch"),
    "save_steps": _ours("checkpoint.every_n_steps"),
    "save_total_limit": _ours("checkpoint.total_limit"),
    "save_only_model": NOT_YET,
    "save_on_each_node": NOT_YET,
    "enable_jit_checkpoint": _instead("SIGTERM, SIGINT and SLURM's SIGUSR1 always save at the step"),
    "load_best_model_at_end": _ours("checkpoint.export", "best by default"),
    "metric_for_best_model": _ours("early_stopping.monitor"),
    "greater_is_better": _ours("early_stopping.mode", "max or min"),
    "resume_from_checkpoint": _ours("resume"),
    "ignore_data_skip": _instead("a resume continues the data where it stopped, without replaying it"),
    "restore_callback_states_from_checkpoint": _instead("a checkpoint always holds the loop's state"),
    "push_to_hub": NOT_YET,
    "hub_model_id": NOT_YET,
    "hub_strategy": NOT_YET,
    "hub_token": NOT_YET,
    "hub_private_repo": NOT_YET,
    "hub_always_push": NOT_YET,
    "hub_revision": NOT_YET,
    "dataloader_num_workers": _ours("trainer.num_workers"),
    "dataloader_drop_last": NOT_YET,
    "dataloader_pin_memory": NOT_YET,
    "dataloader_persistent_workers": NOT_YET,
    "dataloader_prefetch_factor": NOT_YET,
    "dataloader_multiprocessing_context": NOT_YET,
    "dataloader_in_order": NOT_YET,
    "train_sampling_strategy": _ours("trainer.group_by_length", "for group_by_length; random otherwise"),
    "group_by_length": _ours("trainer.group_by_length"),
    "length_column_name": NOT_YET,
    "remove_unused_columns": _instead("a task reads only its own columns"),
    "label_names": NOT_YET,
    "label_smoothing_factor": _ours("task.label_smoothing", "text classification's training loss"),
    "average_tokens_across_devices": _instead("the loss is always the mean over the items of every process "
                                              "(docs/runtime.md)"),
    "include_num_input_tokens_seen": NOT_YET,
    "neftune_noise_alpha": NOT_YET,
    "use_liger_kernel": _instead("task.loss_chunk keeps the vocabulary-sized logits out of memory"),
    "liger_kernel_config": NOT_YET,
    "use_cpu": _ours("hardware=cpu"),
    "local_rank": _instead("read from torchrun's environment"),
    "ddp_backend": _instead("chosen by hardware="),
    "ddp_timeout": _ours("hardware.collective_timeout_s"),
    "ddp_find_unused_parameters": NOT_YET,
    "ddp_bucket_cap_mb": NOT_YET,
    "ddp_broadcast_buffers": NOT_YET,
    "ddp_static_graph": NOT_YET,
    "fsdp": _ours("hardware=fsdp"),
    "fsdp_config": _ours("hardware.fsdp_reshard_after_forward"),
    "deepspeed": NOT_YET,
    "accelerator_config": _ours("hardware.<key>"),
    "parallelism_config": NOT_YET,
    "debug": NOT_YET,
    "skip_memory_metrics": NOT_YET,
    "torch_empty_cache_steps": NOT_YET,
    "use_cache": _instead("generation uses the cache; training does not"),
}

# Shared by TRL's trainers (SFTConfig, DPOConfig, GRPOConfig, RewardConfig).
_TRL_COMMON: dict[str, Counterpart] = {
    "model_init_kwargs": _ours("task.attn_implementation", "the weights load in float32; precision= autocasts"),
    "trust_remote_code": NOT_YET,
    "router_aux_loss_coef": NOT_YET,
    "dataset_num_proc": _ours("task.num_proc"),
    "max_length": _ours("task.block_size"),
    "max_seq_length": _ours("task.block_size"),
    "truncation_mode": _ours("task.overlong", "truncate keeps the start, as keep_start; task.truncation_mode is "
                                              "which end of a prompt cut to task.max_prompt_length stays"),
    "padding_free": _ours("task.packing", "packed rows have no padding between sequences"),
    "pad_to_multiple_of": NOT_YET,
    "pad_token": NOT_YET,
    "activation_offloading": NOT_YET,
    "disable_dropout": NOT_YET,
    "shuffle_dataset": _instead("the training data is always shuffled"),
    "sync_ref_model": _ours("task.sync_ref_every", "TR-DPO: every this many steps; null never"),
    "ref_model_mixup_alpha": _ours("task.sync_ref_alpha"),
    "ref_model_sync_steps": _ours("task.sync_ref_every"),
}

_SFT: dict[str, Counterpart] = {
    "chat_template_path": _ours("task.chat_template"),
    "dataset_text_field": _ours("task.text_field"),
    "dataset_kwargs": NOT_YET,
    "eos_token": NOT_YET,
    "packing": _ours("task.packing"),
    "packing_strategy": _instead("packing is best-fit decreasing (bfd), no conversation split"),
    "eval_packing": _instead("evaluation is packed as training is"),
    "completion_only_loss": _ours("task.train_on=completion"),
    "assistant_only_loss": _ours("task.train_on=assistant"),
}

_DPO: dict[str, Counterpart] = {
    "beta": _ours("task.beta"),
    "label_smoothing": _ours("task.label_smoothing"),
    "loss_type": _ours("task.loss_type", "TRL's names, or a list with task.loss_weights; task=sft's loss is nll"),
    "loss_weights": _ours("task.loss_weights"),
    "precompute_ref_log_probs": _ours("task.reference=precomputed"),
    "precompute_ref_batch_size": _ours("task.reference_batch_size"),
    "ld_alpha": _ours("task.ld_alpha"),
    "f_divergence_type": NOT_YET,
    "f_alpha_divergence_coef": NOT_YET,
    "use_weighting": _ours("task.use_weighting"),
    "discopop_tau": _ours("task.discopop_tau"),
    "max_prompt_length": _ours("task.max_prompt_length"),
    "max_completion_length": _ours("task.max_completion_length", "task=grpo's; task=dpo cuts answers at "
                                                                 "task.block_size"),
    "rpo_alpha": _instead("task.loss_type=[sigmoid,sft] task.loss_weights=[1,<rpo_alpha>]"),
    "generate_during_eval": NOT_YET,
}

_GRPO: dict[str, Counterpart] = {
    "num_generations": _ours("task.num_generations"),
    "steps_per_generation": _ours("task.steps_per_generation"),
    "temperature": _ours("task.temperature"),
    "top_p": _ours("task.top_p"),
    "top_k": _ours("task.top_k"),
    "num_iterations": _ours("task.num_iterations"),
    "epsilon": _ours("task.epsilon"),
    "epsilon_high": _ours("task.epsilon_high"),
    "scale_rewards": _ours("task.scale_rewards"),
    "mask_truncated_completions": _ours("task.mask_truncated_completions"),
    "reward_weights": _ours("task.rewards", "each entry's weight: {_target_: ..., weight: 0.2}"),
    "log_completions": _instead("every completion goes to <run>/completions.jsonl, a sample to the trackers"),
    "use_vllm": _instead("generation runs in the training processes (no vLLM)"),
}
"""GRPOConfig's options that task=grpo has; its others are not here yet."""

_GRPO_NOT_YET = (
    "cast_lm_head_to_fp32", "num_generations_eval", "ds3_gather_for_generation",
    "generation_batch_size", "min_p", "generation_kwargs",
    "chat_template_kwargs", "repetition_penalty", "cache_implementation", "vllm_mode", "vllm_model_impl",
    "vllm_enable_sleep_mode", "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
    "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size", "delta",
    "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
    "vespo_lambda_neg", "importance_sampling_level", "multi_objective_aggregation",
    "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min",
    "entropy_coef_max", "entropy_coef_delta", "entropy_target", "max_tool_calling_iterations",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap", "off_policy_mask_threshold",
    "use_bias_correction_kl", "log_multimodal", "num_completions_to_print", "log_unique_prompts",
    "log_completions_hub_repo", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
    "use_transformers_paged",
)

_REWARD: dict[str, Counterpart] = {
    "center_rewards_coefficient": _ours("task.center_rewards_coefficient"),
}
"""RewardConfig's own option (task=reward_model's); its others are shared ones above."""

TRL_NAMES: dict[str, Counterpart] = {**_TRAINING_ARGUMENTS, **_TRL_COMMON, **_SFT, **_DPO, **_GRPO,
                                     **dict.fromkeys(_GRPO_NOT_YET, NOT_YET), **_REWARD}
"""Every option name of TrainingArguments and TRL's SFT, DPO, GRPO and reward model configs, with ours."""
