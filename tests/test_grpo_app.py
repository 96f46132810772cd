"""``task=grpo`` as a user runs it: a reward the untrained tiny model earns now and then (the share of its words
that are "the") rises above 0.9 within 60 steps, with TRL's metrics in ``metrics.jsonl``, every completion in
``completions.jsonl``, ``eval/reward`` monitored and the best weights exported with a model card; bad input
(a reward that does not import, returns one value for all, words, no opinion at all, raises; no prompt
column; a prompt that leaves no room for the completion) stops the run with one sentence naming the
function and the step, exit status 1 mid-run with the checkpoints kept.

Exact resume: a run SIGKILLed while saving, resumed from a checkpoint taken in the middle of a generation
batch, ends with the uninterrupted run's weights bit for bit, without generating that batch again
(``completions.jsonl`` the same, no line twice), on one process, DDP and FSDP2; and one SGD step is the same
update (1e-5) at batch 4, 2 × accumulation 2, 2 processes (DDP, FSDP2) and steps_per_generation ≠ accumulation,
from the same completions.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from app.config import ConfigError, InputError
from app.engine.run import run as run_in_process
from tests.conftest import REPO, compose_config, run_app
from tests.helpers.metrics_rows import metrics_rows
from tests.helpers.tiny_chat import exchange, make_tiny_chat_llama, write_jsonl

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")
REWARDS = "tests.helpers.grpo_rewards"
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[str, ...]:
    """A saved tiny Llama with ChatML (its weights start every run) and 120 + 8 questions of the toy grammar,
    each with its answer's subject in an ``answer`` column."""
    import random

    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("grpo_app")
    model = make_tiny_chat_llama(folder / "model", hidden=16, layers=1, heads=2, kv_heads=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).save_pretrained(model)
    rng = random.Random(3)

    def rows(n: int) -> list[dict]:
        made = []
        for _ in range(n):
            question, answer = exchange(rng)
            made.append({"prompt": [{"role": "user", "content": question}], "answer": answer.split()[1]})
        return made

    write_jsonl(folder / "train.jsonl", rows(120))
    write_jsonl(folder / "val.jsonl", rows(8))
    return ("task=grpo", f"task.model={model}", f"task.data_files.train={folder / 'train.jsonl'}",
            f"task.data_files.validation={folder / 'val.jsonl'}", f"task.cache_dir={folder / 'cache'}",
            "task.block_size=64", *QUIET)


def reward_list(*names: str) -> str:
    return "task.rewards=[" + ", ".join(f"{{_target_: {REWARDS}.{n}}}" for n in names) + "]"


# -- it learns, and writes what it generated ---------------------------------------------------------------


def test_a_reward_the_model_earns_sometimes_rises_above_0_9_and_the_run_writes_its_completions(
        tmp_path, prompts, caplog):
    run = tmp_path / "learn"
    args = (*prompts, "task.rewards=[{_target_: " + REWARDS + ".word_share}, {_target_: " + REWARDS
            + ".answer_given, weight: 0.0}]", "task.num_generations=8", "task.max_completion_length=8",
            "trainer.batch_size=4", "trainer.max_steps=60", "trainer.max_epochs=-1", "trainer.log_every_n_steps=5",
            "trainer.eval_every_n_steps=20", "optim.lr=1e-2", "scheduler=constant", "checkpoint.export=best",
            "early_stopping.patience=null")
    with caplog.at_level(logging.INFO, logger="app"):
        run_in_process(compose_config(*args, f"hydra.run.dir={run}"), run)
    assert ("each optimizer step trains on 32 completions of 4 prompts (trainer.batch_size=4 prompts per process per "
            "micro-batch × task.num_generations=8 × trainer.gradient_accumulation_steps=1 × 1 process(es))"
            in caplog.text)
    rows = metrics_rows(run)
    trained = [r for r in rows if "train/reward" in r]
    assert trained[0]["train/reward"] < 0.05 and max(r["train/reward"] for r in trained) >= 0.9, \
        [round(r["train/reward"], 3) for r in trained]
    names = {"train/loss", "train/reward", "train/reward_std", "train/frac_reward_zero_std",
             "train/rewards/word_share/mean", "train/rewards/word_share/std", "train/rewards/answer_given/mean",
             "train/completions/mean_length", "train/completions/min_length", "train/completions/max_length",
             "train/completions/clipped_ratio", "train/entropy", "train/clip_ratio/low_mean",
             "train/clip_ratio/high_mean", "train/clip_ratio/region_mean", "train/clip_ratio/low_min",
             "train/clip_ratio/high_max", "train/time/generation_s", "train/time/rewards_s"}
    assert names <= set(trained[-1]), names - set(trained[-1])
    assert "train/kl" not in trained[-1]  # beta = 0: no KL term, no reference
    evaluations = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evaluations] == [20, 40, 60]
    assert {"eval/rewards/word_share/mean", "eval/rewards/answer_given/mean", "eval/completions/mean_length"} <= set(
        evaluations[-1])
    assert evaluations[-1]["eval/reward"] > 0.9 > evaluations[0]["eval/reward"]
    # Every completion, once, with its rewards and advantage.
    lines = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 60 * 4 * 8
    assert [(line["step"], line["k"]) for line in lines[:9]] == [(0, k) for k in range(8)] + [(0, 0)]
    first = lines[0]
    assert set(first) == {"step", "prompt_index", "k", "prompt", "completion", "rewards", "reward", "advantage",
                          "truncated"}
    assert first["prompt"][0]["role"] == "user" and set(first["rewards"]) == {"word_share", "answer_given"}
    assert len({(line["step"], line["prompt_index"], line["k"]) for line in lines}) == len(lines)
    samples = [json.loads(line) for line in (run / "samples" / "step_60.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and {"prompt", "completion", "reward", "advantage"} <= set(samples[0])
    exported = json.loads((run / "model" / "export.json").read_text())
    assert exported["metrics"]["eval/reward"] == max(r["eval/reward"] for r in evaluations)
    card = (run / "model" / "README.md").read_text()
    assert "GRPO (dapo loss, no KL term), 8 completions per prompt of up to 8 tokens" in card
    assert "word_share (× 1), answer_given (× 0)" in card


# -- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("override", "error", "sentence"), [
    (reward_list("nowhere"), ConfigError,
     f"task.rewards[0]._target_={REWARDS}.nowhere: module {REWARDS} has no nowhere."),
    ("task.rewards=[{_target_: nopkg.grade}]", ConfigError,
     "task.rewards[0]._target_=nopkg.grade cannot be imported (No module named 'nopkg')"),
    (reward_list("word_share", "one_value"), InputError,
     ("task.rewards[1] (one_value) at step 0 returned 1 value for 8 completions (one per completion, None for no "
     "opinion).")),
    (reward_list("words"), InputError,
     "task.rewards[0] (words) at step 0 returned 'good' for completion 0, which is neither a finite number nor None."),
    (reward_list("no_opinion"), InputError, ("every reward returned None for all 8 completions at step 0: nothing to "
                                            "learn from")),
    (reward_list("fails_on_third_call"), InputError,
     ("task.rewards[0] (fails_on_third_call) raised ValueError at step 2: the grader is down; first prompt: "
     "\"[{'role': 'user', 'content': 'what did")),
    ("task.max_completion_length=50", ConfigError,
     ("line 1: its prompt is 16 tokens, which leaves no room for task.max_completion_length=50 within "
     "task.block_size=64")),
    ("task.prompt_field=question", ConfigError, "train.jsonl has no 'question' column (it has prompt, answer)"),
])
def test_bad_input_is_refused_in_one_sentence_naming_the_function_and_the_step(tmp_path, prompts, override, error,
                                                                              sentence, monkeypatch):
    import tests.helpers.grpo_rewards as rewards

    monkeypatch.setitem(rewards._CALLS, "n", 0)
    rewarded = () if override.startswith("task.rewards") else (reward_list("word_share"),)
    args = (*prompts, *rewarded, override, "task.num_generations=4", "task.max_completion_length=6",
            "trainer.batch_size=2", "trainer.max_steps=4")
    if override.startswith("task.max_completion_length"):
        args = tuple(a for a in args if a != "task.max_completion_length=6") + (override,)
    with pytest.raises(error) as refused:
        run_in_process(compose_config(*args), tmp_path)
    assert sentence in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_reward_that_raises_mid_run_exits_1_with_its_sentence_and_the_checkpoints_kept(tmp_path, prompts):
    run = tmp_path / "fails"
    proc = run_app(*prompts, reward_list("fails_on_third_call"), "task.num_generations=4",
                   "task.max_completion_length=6", "trainer.batch_size=2", "trainer.max_steps=6",
                   "checkpoint.every_n_steps=1", f"hydra.run.dir={run}", cwd=tmp_path, env=ENV)
    assert proc.returncode == 1, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and said[0].startswith(
        "error: task.rewards[0] (fails_on_third_call) raised ValueError at step 2: the grader is down; first prompt: "
        "\"[{'role': 'user', 'content': 'what did ") and said[0].endswith("?'}]\"."), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    from app.distributed.checkpoint.store import complete_checkpoints

    assert [step for _, manifest in complete_checkpoints(run / "checkpoints") for step in [manifest.step]] == [1, 2]
    assert json.loads((run / "result.json").read_text())["status"] == "failed"


# -- exact resume ------------------------------------------------------------------------------------------

RESUMED = ("task.num_generations=4", "task.max_completion_length=6", "trainer.batch_size=2",
           "task.steps_per_generation=3", "trainer.max_steps=6", "checkpoint.every_n_steps=2",
           "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=6", "checkpoint.export=last",
           "early_stopping.patience=null", "optim.lr=1e-2", "scheduler=constant", "task.beta=0.04")
"""Generation batches of 3 micro-batches, one optimizer step each, saved every 2 steps: the saves at steps 2 and
4 fall inside a generation batch (the clipped ratio then needs the generation-time log-probabilities); a KL term
to a frozen copy of the starting weights (made again from them, not from the checkpoint's, on resume)."""


def killed_and_resumed(tmp_path: Path, prompts: tuple[str, ...], *hardware: str) -> tuple[Path, Path]:
    """The uninterrupted run, and the same run SIGKILLed half-way through its second save (step 4), resumed
    from its first (step 2: the generation batch of steps 0-2 has one micro-batch left)."""
    from app.distributed.checkpoint.store import FAULT_ENV

    args = (*prompts, reward_list("even_tokens", "short"), *RESUMED, *hardware)
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    run_app(*args, f"hydra.run.dir={reference}", cwd=tmp_path, env=ENV, check=True, timeout=300)
    proc = run_app(*args, f"hydra.run.dir={killed}", cwd=tmp_path, env={**ENV, FAULT_ENV: "files:1"}, timeout=300)
    assert proc.returncode != 0 and not (killed / "model").exists()
    run_app(f"resume={killed}", cwd=tmp_path, env=ENV, check=True, timeout=300)
    return reference, killed


def assert_the_same_run(reference: Path, resumed: Path) -> None:
    weights = "model/model.safetensors"
    assert (resumed / weights).read_bytes() == (reference / weights).read_bytes()
    lines = (resumed / "completions.jsonl").read_text().splitlines()
    assert lines == (reference / "completions.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 3 * 2 * 4 * (2 if "num_processes=2" in (reference / ".hydra" / "overrides.yaml")
                                          .read_text() else 1)  # 2 generation batches of 3 x 2 prompts x 4
    assert "resumed from" in (resumed / "app.log").read_text()
    assert [r["train/kl"] for r in metrics_rows(reference) if "train/kl" in r][-1] > 0  # the copy is not the policy


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_and_resumed_mid_generation_batch_is_the_uninterrupted_run(tmp_path, prompts):
    assert_the_same_run(*killed_and_resumed(tmp_path, prompts))


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("hardware", ["multi_cpu", "fsdp"])
def test_on_two_processes_killed_and_resumed_mid_generation_batch_is_the_uninterrupted_run(tmp_path, prompts,
                                                                                            hardware):
    assert_the_same_run(*killed_and_resumed(tmp_path, prompts, f"hardware={hardware}", "hardware.num_processes=2"))


# -- one SGD step at every split ---------------------------------------------------------------------------

SPLITS = {  # per-process prompts per micro-batch, accumulation, processes, hardware, steps_per_generation
    "batch 4": (4, 1, 1, "cpu", None),
    "batch 2 x 2 accumulated": (2, 2, 1, "cpu", None),
    "batch 1 x 4 accumulated, generations of 2 micro-batches": (1, 4, 1, "cpu", 2),
    "batch 2 x 2 processes": (2, 1, 2, "multi_cpu", None),
    "batch 1 x 2 accumulated x 2 processes on FSDP2": (1, 2, 2, "fsdp", None),
}


def weights(path: Path) -> torch.Tensor:
    tensors = load_file(path)
    return torch.cat([tensors[k].double().flatten() for k in sorted(tensors)])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_one_sgd_step_is_the_same_at_every_split_from_the_same_completions(tmp_path, prompts):
    args = (*prompts, reward_list("even_tokens", "short"), "task.num_generations=4", "task.max_completion_length=6",
            "trainer.max_steps=1", "trainer.max_epochs=-1", "optim=sgd", "optim.lr=0.5", "optim.momentum=0.0", "scheduler=constant",
            "trainer.max_grad_norm=null", "checkpoint.every_epoch=false", "checkpoint.export=last",
            "early_stopping.patience=null")
    start = weights(Path(prompts[1].split("=", 1)[1]) / "model.safetensors")
    updates, completions = {}, {}
    for name, (batch, accumulation, processes, hardware, slices) in SPLITS.items():
        run = tmp_path / name.replace(" ", "_").replace(",", "")
        split = (f"trainer.batch_size={batch}", f"trainer.gradient_accumulation_steps={accumulation}",
                 f"task.steps_per_generation={slices if slices is not None else 'null'}", f"hydra.run.dir={run}")
        if processes == 1:
            run_in_process(compose_config(*args, *split), run)
        else:
            run_app(*args, *split, f"hardware={hardware}", f"hardware.num_processes={processes}", cwd=tmp_path,
                    env=ENV, check=True, timeout=300)
        updates[name] = weights(run / "model" / "model.safetensors") - start
        completions[name] = sorted((line["prompt_index"], line["k"], line["completion"]) for line in map(
            json.loads, (run / "completions.jsonl").read_text().splitlines()))
    reference = updates["batch 4"]
    assert reference.norm() > 0
    gaps = {name: float((update - reference).norm() / reference.norm()) for name, update in updates.items()}
    print("update gaps vs batch 4:", gaps)  # for the record (pytest -s)
    assert all(gap <= 1e-5 for gap in gaps.values()), gaps
    assert all(made == completions["batch 4"] for made in completions.values())
    assert len(completions["batch 4"]) == 16


# -- LoRA, bf16, gradient checkpointing, a KL term, a reward model, a sweep; mode=eval ---------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sweep_of_lora_bf16_checkpointed_runs_with_a_kl_and_a_reward_model_trains_exports_and_evaluates(
        tmp_path, prompts):
    """Two jobs (dapo, grpo): LoRA with its adapters off as the KL's reference, bf16 autocast, recomputed
    activations, a one-label classifier as a second reward; each exports its adapter and merged weights,
    which ``mode=eval`` evaluates to the run's own last ``eval/reward``."""
    from transformers import AutoModelForSequenceClassification

    from tests.helpers.text_data import vocabulary_text
    from tests.helpers.tiny_bert import make_tiny_bert

    judge = make_tiny_bert(tmp_path / "judge", vocabulary_text(), dropout=0.0)
    AutoModelForSequenceClassification.from_pretrained(judge, num_labels=1, ignore_mismatched_sizes=True
                                                       ).save_pretrained(judge)
    sweep = tmp_path / "sweep"
    run_app("-m", *prompts, f"task.rewards=[{{_target_: {REWARDS}.word_share}}, {{reward_model: {judge}, "
            "name: judge, weight: 0.5}]", "task.num_generations=4", "task.max_completion_length=6",
            "trainer.batch_size=2", "trainer.max_steps=3", "trainer.max_epochs=-1", "trainer.log_every_n_steps=1",
            "adapter=lora", "precision=bf16", "trainer.gradient_checkpointing=true", "task.beta=0.04",
            "task.reference=base", "task.loss_type=dapo,grpo", "optim.lr=1e-3", f"hydra.sweep.dir={sweep}",
            cwd=tmp_path, env=ENV, check=True, timeout=400)
    assert len((sweep / "sweep.csv").read_text().splitlines()) == 3  # a header, two jobs
    for job in ("0", "1"):
        run = sweep / job
        trained = [r for r in metrics_rows(run) if "train/loss" in r]
        assert len(trained) == 3 and all(r["train/kl"] >= 0 for r in trained)
        assert {"train/rewards/judge/mean", "train/rewards/word_share/mean"} <= set(trained[-1])
        assert (run / "model" / "adapter" / "adapter_config.json").exists()
        final = [r for r in metrics_rows(run) if "eval/reward" in r][-1]
        out = tmp_path / f"eval-{job}"
        out.mkdir()
        overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())  # the job's own
        run_in_process(compose_config(*overrides, "mode=eval", f"resume={run / 'model'}"), out)
        measured = json.loads((out / "eval_metrics.json").read_text())["metrics"]
        assert measured["eval/reward"] == pytest.approx(final["eval/reward"], rel=1e-4, abs=1e-6)
    assert "GRPO (grpo loss, β = 0.04, reference: base)" in (sweep / "1" / "model" / "README.md").read_text()


def test_hardware_tpu_is_refused_in_one_sentence(prompts):
    """Generation with fixed shapes (a bounded number of XLA graphs) is not built: a runtime that needs static
    shapes is refused before any data is read."""
    from app.tasks import build_task

    class StaticShapes:
        static_shapes = True

    task = build_task(compose_config(*prompts, reward_list("word_share"), "task.max_completion_length=6").task)
    with pytest.raises(ConfigError, match="hardware=tpu compiles a graph for each shape it meets: generation with "
                                          "fixed shapes is not built yet"):
        task.build_data(StaticShapes())  # type: ignore[arg-type]


def test_a_class_entry_is_instantiated_once_with_its_keyword_arguments(tmp_path, prompts, monkeypatch):
    import tests.helpers.grpo_rewards as rewards

    monkeypatch.setattr(rewards.Offset, "instances", 0)
    run = tmp_path / "offset"
    run_in_process(compose_config(*prompts, f"task.rewards=[{{_target_: {REWARDS}.Offset, offset: 0.5}}]",
                                  "task.num_generations=2", "task.max_completion_length=4", "trainer.batch_size=2",
                                  "trainer.max_steps=3", "trainer.max_epochs=-1", f"hydra.run.dir={run}"), run)
    lines = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 2 * 2 and {line["rewards"]["Offset"] for line in lines} == {0.5}
    assert rewards.Offset.instances == 1 and {line["advantage"] for line in lines} == {0.0}
