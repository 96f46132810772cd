"""``GRPOTask``: online reinforcement learning from rewards the user writes. ``task=sft``'s model, tokenizer,
chat template, chunked log-probabilities and export, ``task=dpo``'s reference options; prompts are read as
sft reads rows (``prompts.py``), completions generated with the current weights and scored
(``generation.py``), and each batch of prompts becomes the micro-batches the engine trains on
(``app.tasks.base.MakesTrainingBatches``, the engine's one hook for it: ``Accelerator.expand_batches``).

A loader batch holds ``task.steps_per_generation`` (S) × ``trainer.batch_size`` (B) prompts per process:
each is completed ``task.num_generations`` (G) times, the generation batch is gathered, and each process
trains on its own prompts' completions, B prompts (B·G rows) per micro-batch, S micro-batches, ``task.
num_iterations`` times. The loss (``loss.py``) is per completion with its items (tokens for ``dapo``), so the
engine's item-normalised step is the token mean over the whole optimizer step at any split. Evaluation
generates for the validation prompts (the same noise at every evaluation) and reports ``eval/reward``,
``eval/rewards/<name>/mean`` and ``eval/completions/mean_length`` (``SummedMetrics``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import ConfigError, InputError
from app.run_folder.layout import completions_file
from app.tasks.base import BatchPlan, StepOutput, TaskData, TaskRuntime
from app.tasks.causal_lm.documents import hold_out
from app.tasks.causal_lm.models import model_source
from app.tasks.dpo.config import Reference
from app.tasks.dpo.reference import AdaptersDisabled, FrozenCopy
from app.tasks.grpo.config import GRPOConfig
from app.tasks.grpo.generation import Prompts, RolloutMaker
from app.tasks.grpo.loss import GRPOLossOutput, Objective, grpo_loss, logp_entropy_values
from app.tasks.grpo.prompts import PromptFields, encode_prompts, prompt_features
from app.tasks.grpo.rewards import load_rewards, place_reward_models
from app.tasks.grpo.rollouts import GENERATION_METRICS_KEY, GenerationBuffer, Layout, Rollouts, micro_batches
from app.tasks.sft.bad_rows import skipped_of
from app.tasks.sft.chunked import losses_from_head
from app.tasks.sft.records import Places, sample_records
from app.tasks.sft.task import SFTTask
from app.tasks.text.sources import Split, check_data_files
from app.tasks.text.task import digest, run_main_first
from app.tasks.text.tokenization import cache_root, tokenizer_fingerprint

if TYPE_CHECKING:
    import datasets

CACHE_VERSION = 1
"""Part of the cache key: bump it when ``encode_prompts`` changes what it produces."""
TOKEN_METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""TRL's metrics that are means over completion tokens (``kl`` too, with task.beta > 0)."""
EXTREME_METRICS = ("clip_ratio/low_min", "clip_ratio/high_max")


def collate_prompts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompts into a loader batch: their indices (a tensor), token ids, prompts and other columns (JSON)."""
    return {"index": torch.tensor([r["index"] for r in rows], dtype=torch.int64),
            "prompt_ids": [list(r["prompt_ids"]) for r in rows], "prompt": [r["prompt"] for r in rows],
            "columns": [r["columns"] for r in rows]}


class GRPOTask(SFTTask):
    def __init__(self, cfg: GRPOConfig):
        super().__init__(cfg)
        self.cfg: GRPOConfig = cfg
        self.specs = cfg.reward_specs()
        self.metric_names = ("reward", *(f"rewards/{s.name}/mean" for s in self.specs),  # type: ignore[assignment]
                             "completions/mean_length")
        self.conversational = False
        self.objective = Objective(cfg.loss_type, cfg.epsilon, cfg.clip_high, cfg.beta, cfg.max_completion_length)
        self._runtime: TaskRuntime | None = None
        self._maker: RolloutMaker | None = None
        self.buffer = GenerationBuffer()
        self.reference: FrozenCopy | AdaptersDisabled | None = \
            AdaptersDisabled() if cfg.beta > 0 and cfg.reference is Reference.base else None
        self._layout = Layout(1, 1, 1)
        self._old_logps_needed = False
        self._generation_metrics: tuple[str, ...] = ()

    # -- data ----------------------------------------------------------------------------------------------

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        check_data_files(self.cfg.data_files)
        if runtime.static_shapes:
            raise ConfigError("task=grpo generates completions of every length, and hardware=tpu compiles a graph for "
                              "each shape it meets: generation with fixed shapes is not built yet; use hardware=gpu, "
                              "cpu or fsdp.")
        if not runtime.is_main_process:
            import datasets

            datasets.disable_progress_bars()
        seed = torch.initial_seed()  # the run's seed (set_seed at its start): the rollouts' keys
        self._runtime = runtime
        train, evaluation = run_main_first(runtime, self._prompts_read)
        rewards = load_rewards(self.specs)
        tokenizer = self.tokenizer
        stops = [t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(self.end_of_turn)
                             if self.end_of_turn is not None else None) if isinstance(t, int)]
        if not stops:
            raise ConfigError(f"the tokenizer of {model_source(self.cfg)} has no EOS token and no end of turn: "
                              "generation would never stop before task.max_completion_length; give one.")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
        self._maker = RolloutMaker(self.cfg, tokenizer, rewards, runtime, seed, list(dict.fromkeys(stops)), pad)
        if runtime.is_main_process and runtime.project_dir is not None:
            self.buffer.completions_file = completions_file(runtime.project_dir)
        runtime.register_for_checkpointing(self.buffer)
        place_reward_models(rewards, runtime.device)
        return TaskData(train=train, eval=evaluation, collate_fn=collate_prompts)

    def _prompts_read(self) -> tuple[datasets.Dataset, datasets.Dataset]:
        """Both splits read, checked and tokenized (cached), held out; each prompt numbered (training prompts
        first): the number keys its completions."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        splits = self._read(root / "raw")
        train, _ = splits["train"]
        sample = sample_records(train.data)
        columns = list(dict.fromkeys(key for record in sample for key in record))
        if cfg.prompt_field not in columns:
            raise ConfigError(f"{train.origin} has no {cfg.prompt_field!r} column (it has {', '.join(columns) or 'none'}); "
                              "task=grpo reads one prompt per row, a list of messages or a string: set "
                              "task.prompt_field.")
        if any(isinstance(record.get(cfg.prompt_field), list) for record in sample):
            self.conversational = True
            self._check_template()
        rows, read = {}, []
        for name, (split, places) in splits.items():
            data, said = self._tokenize(split, places, name, root)
            if len(data) == 0:
                raise ConfigError(f"{split.origin} has no prompt to train on{said}.")
            rows[name] = Split(data, digest(split.fingerprint, "grpo-prompts"), split.origin)
            read.append(f"{name}: {len(data):,} prompts of {split.origin}"
                        f" ({'conversations' if self.conversational else 'text'}){said}")
        if "validation" not in rows:
            rows["train"], rows["validation"] = hold_out(rows["train"], cfg.eval_fraction, cfg.split_seed)
            read.append(f"evaluation: {len(rows['validation'].data):,} of them held out (task.eval_fraction="
                        f"{cfg.eval_fraction}, task.split_seed={cfg.split_seed})")
        self._splits_read = read
        train_rows, eval_rows = rows["train"].data, rows["validation"].data
        train_rows = train_rows.add_column("index", list(range(len(train_rows))))
        eval_rows = eval_rows.add_column("index", list(range(len(train_rows), len(train_rows) + len(eval_rows))))
        return train_rows, eval_rows

    def _tokenize(self, split: Split, places: Places, name: str, root: Path) -> tuple[datasets.Dataset, str]:
        """The split's prompts (cached), its bad rows judged (``task.bad_rows``), the dropped ones left out."""
        cfg = self.cfg
        fields = PromptFields(cfg.prompt_field, cfg.tools_field, cfg.block_size, cfg.max_completion_length,
                              cfg.overlong, places)
        payload = {"version": CACHE_VERSION, "tokenizer": tokenizer_fingerprint(self.tokenizer),
                   "template": self.tokenizer.chat_template, "fields": {**asdict(fields), "places": places.unit},
                   "data": split.fingerprint}
        key = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
        root.mkdir(parents=True, exist_ok=True)
        data = split.data.map(functools.partial(encode_prompts, tokenizer=self.tokenizer, fields=fields), batched=True,
                              with_indices=True, remove_columns=split.data.column_names, new_fingerprint=key,
                              features=prompt_features(), desc=f"Tokenizing {cfg.name} {name}",
                              num_proc=cfg.num_proc if len(split.data) >= 2 * cfg.num_proc > 2 else None,
                              cache_file_name=str(root / f"grpo-{name}-{key}.arrow"), load_from_cache_file=True)
        bad = skipped_of(data, places)
        self._judge(bad, len(data), places.origin)
        dropped = sum(data["dropped"])
        if dropped or bad:
            data = data.select([i for i, (d, e) in enumerate(zip(data["dropped"], data["error"], strict=True))
                                if not d and not e])
        said = (f", {len(bad):,} bad row(s) skipped (skipped_rows.jsonl)" if bad else "") + (
            f", {dropped:,} dropped as leaving no room for task.max_completion_length={cfg.max_completion_length} "
            f"(task.overlong=drop)" if dropped else "")
        return data.select_columns(["prompt_ids", "prompt", "columns"]), said

    # -- model ---------------------------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        model = super().build_model()
        if self.cfg.beta > 0 and self.cfg.reference is Reference.copy and self.reference is None:
            if self._runtime is None:
                raise RuntimeError("build_data() keeps the runtime that prepares the reference copy; call it first.")
            self.reference = FrozenCopy(model, self._runtime)  # before any adapter: the starting weights
        return model

    # -- the engine's hook: prompts -> micro-batches -------------------------------------------------------

    def batch_plan(self, batch_size: int, accumulation: int, processes: int) -> BatchPlan:
        cfg = self.cfg
        slices, iterations = cfg.steps_per_generation or accumulation, cfg.num_iterations
        self._layout = Layout(batch_size, slices, iterations)
        per_generation = slices * iterations
        # TRL's rule: the generation-time log-probabilities are needed when a generation batch is trained on
        # across optimizer steps (else the weights are those that generated it: the ratio is 1 by construction).
        self._old_logps_needed = per_generation > 1 and accumulation % per_generation != 0
        self._generation_metrics = (
            "reward", "reward_std", "frac_reward_zero_std",
            *(f"rewards/{s.name}/{what}" for s in self.specs for what in ("mean", "std")),
            "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
            "completions/mean_terminated_length", "completions/min_terminated_length",
            "completions/max_terminated_length", "time/generation_s", "time/rewards_s")
        g, prompts = cfg.num_generations, accumulation * batch_size * processes
        generated = f"{slices * batch_size * processes:,} prompts"
        if per_generation == accumulation:
            every = f"one generation batch of {generated} per optimizer step"
        elif per_generation > accumulation:
            every = f"each generation batch of {generated} trained on over {per_generation / accumulation:g} optimizer steps"
        else:
            every = f"{accumulation / per_generation:g} generation batches of {generated} per optimizer step"
        sentence = (f"each optimizer step trains on {prompts * g:,} completions of {prompts:,} prompts (trainer.batch_size="
                    f"{batch_size} prompts per process per micro-batch × task.num_generations={g} × trainer.gradient_"
                    f"accumulation_steps={accumulation} × {processes} process(es)); {every}"
                    + (f", each trained on {iterations} times" if iterations > 1 else "")
                    + ("; the generation-time log-probabilities are kept for the clipped ratio"
                       if self._old_logps_needed else ""))
        return BatchPlan(draws=slices, micro_batches=per_generation, samples=batch_size * g, sentence=sentence)

    def training_batches(self, model: nn.Module, batch: Any, step: int) -> list[Any]:
        assert self._maker is not None and self._runtime is not None  # build_data ran
        rollouts = self._maker.rollouts(model, Prompts.of(batch), step, self._layout.batch_size, self.buffer.append)
        self.buffer.current = rollouts
        made = self._micro_batches(rollouts)
        if self._old_logps_needed:
            rollouts.old_logps = self._old_logps(model, rollouts, made)
            made = self._micro_batches(rollouts)
        return made

    def pending_batches(self) -> list[Any]:
        rollouts = self.buffer.current
        assert self._runtime is not None
        if rollouts is None:
            raise InputError("the checkpoint was saved in the middle of a generation batch but holds none; it cannot be "
                             "resumed exactly.")
        if rollouts.world != self._runtime.num_processes:
            raise InputError(f"the checkpoint was saved in the middle of a generation batch made by {rollouts.world} "
                             f"process(es): resume it on {rollouts.world} (hardware.num_processes={rollouts.world}), or "
                             "from a checkpoint between generation batches.")
        return self._micro_batches(rollouts)

    def _micro_batches(self, rollouts: Rollouts) -> list[dict[str, Any]]:
        assert self._maker is not None and self._runtime is not None
        return micro_batches(rollouts, self._runtime.process_index, self._layout, self._maker.pad_id,
                             self.cfg.mask_truncated_completions, self._generation_metrics)

    @torch.no_grad()
    def _old_logps(self, model: nn.Module, rollouts: Rollouts, made: list[dict[str, Any]]) -> torch.Tensor:
        """The policy's log-probabilities of every completion of the generation batch as it is now (before any
        optimizer step on them): each process its own slices', then gathered into one table."""
        assert self._runtime is not None
        runtime, g = self._runtime, rollouts.num_generations
        share = len(rollouts.prompt_index) // rollouts.world
        first_row = runtime.process_index * share * g
        mine: list[list[float]] = []
        for micro in made[:self._layout.slices]:
            placed = {k: v.to(runtime.device) if isinstance(v, torch.Tensor) else v for k, v in micro.items()}
            logps, _ = self._completion_values(model, placed)
            mask = placed["attention_mask"][:, placed["completion_start"]:]
            mine += [row[:int(n)] for row, n in zip(logps.float().cpu().tolist(), mask.sum(dim=1).tolist(), strict=True)]
        parts = runtime.gather_object([(first_row, mine)])
        longest = max(len(c) for c in rollouts.completion_ids)
        table = torch.zeros(len(rollouts.completion_ids), longest)
        for start, rows in parts:
            for i, row in enumerate(rows):
                table[start + i, :len(row)] = torch.tensor(row)
        return table

    # -- the loss ------------------------------------------------------------------------------------------

    def _completion_values(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each completion token's log-probability and its distribution's entropy at task.temperature, ``(rows,
        completion length)``, the head applied by chunks from the last prompt position (sft's chunked path), each
        chunk ``task.loss_chunk`` tokens of all the micro-batch's rows together (its B·G rows would otherwise
        multiply the logits a chunk holds)."""
        start, length = batch["completion_start"], batch["input_ids"].shape[1] - batch["completion_start"]
        values = logp_entropy_values(self.cfg.temperature)
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        if self._loss_chunk:
            positions = max(1, self._loss_chunk // batch["input_ids"].shape[0])
            with losses_from_head(model, batch["labels"], positions, values, first=start - 1):
                out = model(**inputs, use_cache=False).logits[:, start - 1:start - 1 + length]
        else:
            logits = model(**inputs, use_cache=False).logits[:, start - 1:start - 1 + length]
            out = values(logits, batch["labels"][:, start:start + length])
        return out[..., 0], out[..., 1]

    def _reference_logps(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return self._completion_values(model, batch)[0]

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Each completion's loss and items (``loss.grpo_loss``) and TRL's training metrics: per token (``kl``,
        ``entropy``, ``clip_ratio/*_mean``), per micro-batch (``clip_ratio/low_min``, ``high_max``) and per
        generation batch (rewards, lengths, time: in its first micro-batch)."""
        logps, entropies = self._completion_values(model, batch)
        ref = None
        if self.cfg.beta > 0:
            assert self.reference is not None  # build_model made it
            ref = self.reference(model, batch, self._reference_logps).to(logps.dtype)
        out = grpo_loss(logps, batch["advantages"], batch["completion_mask"], self.objective, batch.get("old_logps"),
                        ref, entropies)
        metrics, items = self._metrics(out, batch[GENERATION_METRICS_KEY])
        return StepOutput(sample_losses=out.sample_losses, sample_items=out.sample_items.long(),
                          sample_metrics=metrics, sample_metric_items=items)

    def _metrics(self, out: GRPOLossOutput, generation: dict[str, float | None]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        tokens = out.tokens
        metrics, items = {}, {}
        for name in ("kl", *TOKEN_METRICS):
            if name in out.token_sums:
                metrics[name], items[name] = out.token_sums[name], tokens
        first = torch.zeros_like(tokens)
        first[0] = 1
        low, high = out.sequence_clip["clip_ratio/low_min"], out.sequence_clip["clip_ratio/high_max"]
        for name, extreme in ((EXTREME_METRICS[0], low.nan_to_num(nan=torch.inf).min()),
                              (EXTREME_METRICS[1], high.nan_to_num(nan=-torch.inf).max())):
            extreme = torch.where(extreme.isfinite(), extreme, torch.zeros_like(extreme))
            metrics[name], items[name] = first * extreme, first
        for name, value in generation.items():
            metrics[name] = first * (0.0 if value is None else float(value))
            items[name] = torch.zeros_like(first) if value is None else first
        return metrics, items

    # -- evaluation ----------------------------------------------------------------------------------------

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        assert self._maker is not None
        return self._maker.evaluation_sums(model, Prompts.of(batch), "at an evaluation")

    def metrics_from_sums(self, sums: dict[str, float]) -> dict[str, float]:
        def ratio(total: str, count: str) -> float:
            return sums[total] / sums[count] if sums.get(count) else float("nan")

        metrics = {"reward": ratio("reward_sum", "reward_count")}
        for spec in self.specs:
            metrics[f"rewards/{spec.name}/mean"] = ratio(f"{spec.name}/sum", f"{spec.name}/count")
        metrics["completions/mean_length"] = ratio("length_sum", "completions")
        return metrics

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Not called (the engine reduces :meth:`evaluation_sums`)."""
        raise NotImplementedError("task=grpo's evaluation metrics come from evaluation_sums")

    def evaluation_samples(self, model: nn.Module, device: torch.device) -> list[dict[str, str]]:
        """The latest generation batch's first prompt and its completions, with their rewards and advantages
        (``<run>/samples/step_<N>.jsonl``, TensorBoard's text); [] before any."""
        rollouts = self.buffer.current
        if rollouts is None:
            return []
        tokenizer, g = self.tokenizer, rollouts.num_generations
        prompt = str(tokenizer.decode(rollouts.prompt_ids[0], skip_special_tokens=False))
        return [{"step": str(rollouts.step), "prompt": prompt,
                 "completion": str(tokenizer.decode(rollouts.completion_ids[k], skip_special_tokens=True)),
                 "reward": f"{float(rollouts.rewards[k]):.4g}", "advantage": f"{float(rollouts.advantages[k]):.4g}"}
                for k in range(g)]

    def card_facts(self) -> dict[str, str]:
        cfg = self.cfg
        facts = self._card_of_prompts("prompts", self.conversational)
        rewards = ", ".join(f"{s.name} (× {s.weight:g})" for s in self.specs)
        kl = f", β = {cfg.beta}, reference: {cfg.reference.value}" if cfg.beta > 0 else ", no KL term"
        facts["trained on"] = (f"GRPO ({cfg.loss_type.value} loss{kl}), {cfg.num_generations} completions per prompt "
                               f"of up to {cfg.max_completion_length} tokens, rewards: {rewards}")
        return facts

