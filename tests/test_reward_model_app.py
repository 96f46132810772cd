"""``task=reward_model`` as a user runs it (``python -m app``): on a toy preference set (the chosen answer
keeps the grammar's subject/verb rule, the rejected one breaks it) a tiny Llama learns to score the chosen
answers higher (``eval/accuracy`` ≥ 0.9, monitored by early stopping), TRL's metrics are logged; the export,
loaded with Transformers alone, ranks the held-out pairs as the run's metric says, and ``mode=eval`` with
``task.predict_test=true`` writes every evaluation pair's two scores. One SGD step is the same update at
batch 8, at 2 × accumulation 4 and on 2 processes (a pair is one item of the loss, with margins and the
centring term). A run SIGKILLed half-way through a save and resumed ends with the uninterrupted run's
weights, bit for bit. LoRA (the ``score`` head saved whole with the adapter), bf16 and gradient
checkpointing train and export together; a sweep compares its jobs by ``eval/accuracy``. An export trained
on a toy rule is ``task=grpo``'s reward (``{reward_model: <folder>}``), and the policy's reward rises.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from app.engine.run import run as run_in_process
from tests.conftest import compose_config, run_app
from tests.helpers.dpo_pairs import preference_rows
from tests.helpers.metrics_rows import metrics_rows, without_throughput
from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl
from tests.test_dpo_app import data_args as dpo_data_args
from tests.test_dpo_app import prefs  # noqa: F401 - the fixture: a tiny Llama, 240 pairs, 40 held out (seed 7)
from tests.test_grpo_app import REWARDS as GRPO_REWARDS
from tests.test_grpo_app import prompts  # noqa: F401 - the fixture: task=grpo's tiny Llama and 120 + 8 questions
from tests.test_loss_normalisation import ONE_SGD_STEP, assert_same_updates, weights
from tests.test_sft_engine import QUIET, assert_bitwise_equal, killed_and_resumed


def data_args(prefs: Path) -> tuple[str, ...]:  # noqa: F811
    return ("task=reward_model", *dpo_data_args(prefs)[1:])


def transformers_scores(folder: Path, rows: list[dict]) -> list[tuple[float, float]]:
    """Each pair's chosen and rejected score by the export alone: its tokenizer's chat template, a padded
    batch, ``AutoModelForSequenceClassification``'s own pooling."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    texts = [tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=False)
             for row in rows for side in ("chosen", "rejected")]
    inputs = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        scores = model(**inputs).logits[:, 0].tolist()
    return list(zip(scores[::2], scores[1::2], strict=True))


def test_a_run_learns_the_preference_and_its_export_ranks_as_the_run_measured(prefs):  # noqa: F811
    run = prefs / "run"
    run_app(*data_args(prefs), "trainer.max_epochs=5", "optim.lr=1e-3", "trainer.eval_every_n_steps=30",
            "early_stopping.monitor=eval/accuracy", "early_stopping.mode=max", f"hydra.run.dir={run}",
            cwd=prefs, check=True, timeout=300)
    rows = metrics_rows(run)
    evaluations = [r for r in rows if "eval/loss" in r]
    assert len(evaluations) == 5
    first, best = evaluations[0], max(evaluations, key=lambda r: r["eval/accuracy"])
    assert best["eval/accuracy"] >= 0.9 and best["eval/margin"] > first["eval/margin"]
    assert best["eval/loss"] < first["eval/loss"] < 0.7
    assert best["eval/min_reward"] < best["eval/mean_reward"] < best["eval/max_reward"]
    trained = [r for r in rows if "train/loss" in r]
    assert {f"train/{name}" for name in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")} <= set(
        trained[-1])
    assert trained[-1]["train/accuracy"] > max(0.8, trained[0]["train/accuracy"])
    log = (run / "app.log").read_text()
    assert "has no padding token: <|pad|> (id 582) pads instead" in log
    # The export (the best evaluation by eval/accuracy), read with Transformers alone.
    from transformers import AutoConfig, AutoTokenizer

    exported = json.loads((run / "model" / "export.json").read_text())
    metric = exported["metric"]
    assert (metric["name"], metric["value"], exported["step"]) == ("eval/accuracy", best["eval/accuracy"], best["step"])
    config, tokenizer = AutoConfig.from_pretrained(run / "model"), AutoTokenizer.from_pretrained(run / "model")
    assert config.num_labels == 1 and config.pad_token_id == tokenizer.pad_token_id == 582
    assert config.architectures == ["LlamaForSequenceClassification"] and tokenizer.chat_template
    held_out = preference_rows(40, seed=7)
    scores = transformers_scores(run / "model", held_out)
    assert sum(c > r for c, r in scores) / len(scores) == best["eval/accuracy"]
    assert sum(c - r for c, r in scores) / len(scores) == pytest.approx(best["eval/margin"], rel=1e-4)
    card = (run / "model" / "README.md").read_text()
    assert "AutoModelForSequenceClassification.from_pretrained" in card and "higher is better" in card
    # mode=eval of the export: the same metrics, and every evaluation pair's two scores.
    evaluation = prefs / "evaluated"
    evaluation.mkdir()
    run_in_process(compose_config(*data_args(prefs), "mode=eval", f"resume={run}", "task.predict_test=true"),
                   evaluation)
    measured = json.loads((evaluation / "eval_metrics.json").read_text())["metrics"]
    assert measured == pytest.approx({k: v for k, v in best.items() if k.startswith("eval/")}, rel=1e-5)
    with open(evaluation / "test_predictions.tsv", encoding="utf-8") as f:
        predicted = list(csv.DictReader(f, delimiter="\t"))
    assert len(predicted) == 40 and [int(p["pair"]) for p in predicted] == list(range(1, 41))
    for p, (chosen, rejected), row in zip(predicted, scores, held_out, strict=True):
        assert float(p["chosen_score"]) == pytest.approx(chosen, abs=1e-4)
        assert float(p["rejected_score"]) == pytest.approx(rejected, abs=1e-4)
        assert int(p["chosen_ahead"]) == int(chosen > rejected)
        assert row["prompt"][0]["content"] in p["prompt"] and row["chosen"][0]["content"] in p["chosen"]
        assert row["rejected"][0]["content"] in p["rejected"]


@pytest.fixture(scope="module")
def reward_start(tmp_path_factory) -> tuple[str, ...]:
    """A saved one-label classifier (its weights start every run; it has a padding token of its own) and
    pairs of very different lengths, with margins: micro-batches of 2 hold very different token counts."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    folder = tmp_path_factory.mktemp("reward_start")
    model = make_tiny_chat_llama(folder / "model", hidden=16, layers=1, heads=2, kv_heads=1)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    tokenizer.save_pretrained(model)
    config = AutoConfig.from_pretrained(model, num_labels=1, vocab_size=len(tokenizer),
                                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    classifier = LlamaForSequenceClassification(config)
    with torch.no_grad():
        classifier.score.weight.mul_(40.0)  # scores well beyond 0: the loss's every term matters
    classifier.save_pretrained(model)
    train = write_jsonl(folder / "train.jsonl", uneven_pairs(8))
    write_jsonl(folder / "more.jsonl", uneven_pairs(24))  # the resume drill's: rows for 2 processes at batch 2
    return ("task=reward_model", f"task.model={model}", f"task.data_files.train={train}",
            f"task.data_files.validation={train}", f"task.cache_dir={folder / 'cache'}",
            "task.center_rewards_coefficient=0.1", "checkpoint.every_epoch=false", "checkpoint.export=last",
            "early_stopping.patience=null", *QUIET)


def uneven_pairs(n: int) -> list[dict]:
    """Pairs with margins, four short ones then four with answers of several sentences, in turn."""
    pairs = preference_rows(n, seed=2)
    for k, row in enumerate(pairs):
        row["margin"] = [0.0, 0.5, 1.0, -0.5][k % 4]
        if (k // 4) % 2:
            for side in ("chosen", "rejected"):
                row[side] = [{"role": "assistant", "content": " ".join([row[side][0]["content"]] * 4)}]
    return pairs


def one_step_updates(tmp_path: Path, args: tuple[str, ...],
                     splits: dict[str, tuple[int, int, int, str]]) -> dict[str, torch.Tensor]:
    model = Path(next(a for a in args if a.startswith("task.model=")).split("=", 1)[1])
    start, updates = weights(model / "model.safetensors"), {}
    for name, (batch, accumulation, processes, hardware) in splits.items():
        run = tmp_path / name.replace(" ", "_")
        split = (*args, *ONE_SGD_STEP, "trainer.max_steps=1", f"trainer.batch_size={batch}",
                 f"trainer.gradient_accumulation_steps={accumulation}", f"hydra.run.dir={run}")
        if processes == 1:
            run_in_process(compose_config(*split), run)
        else:
            run_app(*split, f"hardware={hardware}", f"hardware.num_processes={processes}", cwd=tmp_path, check=True,
                    timeout=300)
        updates[name] = weights(run / "model" / "model.safetensors") - start
    return updates


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_one_sgd_step_is_the_same_at_batch_8_at_2_x_4_and_on_2_processes(tmp_path, reward_start):
    """Each pair is one item of the step's mean (its margin and centring term with it), and padding changes
    no score: batch 2 with 4 accumulation steps and batch 4 on each of 2 processes make batch 8's update, and
    log its TRL metrics (the means over the step's pairs; the minimum and maximum over its scores)."""
    splits = {"batch 8": (8, 1, 1, "cpu"), "batch 2 x 4": (2, 4, 1, "cpu"),
              "batch 4 x 2 processes": (4, 1, 2, "multi_cpu")}
    assert_same_updates(one_step_updates(tmp_path, reward_start, splits))
    logged = {name: next(r for r in without_throughput(metrics_rows(tmp_path / name.replace(" ", "_")))
                         if "train/loss" in r) for name in splits}
    reference = logged["batch 8"]
    assert reference["train/min_reward"] < reference["train/mean_reward"] < reference["train/max_reward"]
    assert 0 < reference["train/accuracy"] < 1 and reference["train/margin"] != 0
    for name, row in logged.items():
        assert set(row) == set(reference) and row == pytest.approx(reference, rel=1e-5, abs=1e-6), name


def test_a_run_resumed_mid_window_logs_the_uninterrupted_runs_rows(tmp_path, reward_start):
    """Stopped at step 3 of a logging window of two steps and resumed to step 4: the checkpoint held the window's
    partial sums and extremes, so the rows after it are the uninterrupted run's, train/min_reward included."""
    args = (*reward_start, "optim.lr=3e-3", "scheduler=constant", "trainer.batch_size=2", "trainer.log_every_n_steps=2",
            "checkpoint.every_n_steps=3", "trainer.eval_every_n_steps=4")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run_in_process(compose_config(*args, "trainer.max_steps=4", f"hydra.run.dir={whole}"), whole)
    run_in_process(compose_config(*args, "trainer.max_steps=3", f"hydra.run.dir={stopped}"), stopped)
    run_in_process(compose_config(*args, "trainer.max_steps=4", f"resume={stopped}", f"hydra.run.dir={stopped}"),
                   stopped)
    rows = without_throughput(metrics_rows(whole))
    assert [r["step"] for r in rows if "train/min_reward" in r] == [2, 4]
    resumed = without_throughput(metrics_rows(stopped))
    assert [r for r in resumed if not (r["step"] == 3 and "train/loss" in r)] == rows


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_one_sgd_step_under_fsdp2_is_batch_8s_update(tmp_path, reward_start):
    assert_same_updates(one_step_updates(tmp_path, reward_start, {
        "batch 8": (8, 1, 1, "cpu"), "batch 2 x 2 accumulated x 2 processes FSDP2": (2, 2, 2, "fsdp")}))


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("hardware", [pytest.param((), id="one process"), pytest.param(
    ("hardware=fsdp", "hardware.num_processes=2"), id="two FSDP2 processes", marks=pytest.mark.multiprocess)])
def test_killed_mid_save_and_resumed_ends_with_the_uninterrupted_weights(tmp_path, reward_start, hardware):
    """task=sft's drill (9 AdamW steps, packed, SIGKILLed half-way through the second save, resumed from step
    3): packed pairs, margins and the centring term end with the uninterrupted run's weights, bit for bit."""
    more = tuple(a.replace("train.jsonl", "more.jsonl") if a.startswith("task.data_files.train=") else a
                 for a in reward_start)
    assert_bitwise_equal(*killed_and_resumed(tmp_path, more, *hardware))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_bf16_and_gradient_checkpointing_train_and_export_the_head_whole(prefs):  # noqa: F811
    """The adapter folder holds the ``score`` head whole (peft's SEQ_CLS keeps it trainable) and adapters that
    moved; the merged export loads with Transformers alone; ``mode=eval`` of the run measures what it measured.
    (The body is random and frozen: low-rank updates of it hardly learn the toy rule in a few steps.)"""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    run = prefs / "lora"
    run_app(*data_args(prefs), "adapter=lora", "precision=bf16", "trainer.gradient_checkpointing=true",
            "trainer.max_steps=8", "trainer.eval_every_n_steps=8", "trainer.log_every_n_steps=1", "optim.lr=1e-2",
            "checkpoint.export=last", f"hydra.run.dir={run}", cwd=prefs, check=True, timeout=300)
    rows = metrics_rows(run)
    last = [r for r in rows if "eval/loss" in r][-1]
    assert all(math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r) and math.isfinite(last["eval/loss"])
    log = (run / "app.log").read_text()
    assert "gradient checkpointing: LlamaForSequenceClassification" in log and "precision bf16" in log
    adapter = load_file(run / "model" / "adapter" / "adapter_model.safetensors")
    heads = [k for k in adapter if "score" in k]
    assert heads and all(adapter[k].shape[0] == 1 for k in heads)  # the whole one-label head
    assert all(adapter[k].abs().sum() > 0 for k in adapter if "lora_B" in k)  # peft starts them at 0: they trained
    merged = AutoModelForSequenceClassification.from_pretrained(run / "model")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    evaluation = prefs / "lora-evaluated"
    evaluation.mkdir()
    run_in_process(compose_config(*data_args(prefs), "adapter=lora", "precision=bf16", "mode=eval",
                                  f"resume={run}"), evaluation)
    measured = json.loads((evaluation / "eval_metrics.json").read_text())["metrics"]
    assert measured["eval/accuracy"] == last["eval/accuracy"]
    assert measured["eval/loss"] == pytest.approx(last["eval/loss"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sweep_over_the_centring_compares_its_jobs_by_accuracy(prefs):  # noqa: F811
    sweep = prefs / "sweep"
    run_app("-m", *data_args(prefs), "task.center_rewards_coefficient=0.0,0.1", "trainer.max_steps=4",
            "trainer.eval_every_n_steps=4", f"hydra.sweep.dir={sweep}", cwd=prefs, check=True, timeout=300)
    for job in ("0", "1"):
        assert "eval/accuracy" in metrics_rows(sweep / job)[-1]
    assert ("**Not comparable:** eval/loss does not compare across task.center_rewards_coefficient (its value changes "
            "eval/loss's scale), so the best by it is not the best model; rank by one that does: "
            "early_stopping.monitor=eval/accuracy (docs/reward_model.md).") in (sweep / "sweep.md").read_text()


# -- the export as task=grpo's reward -------------------------------------------------------------------------


def the_rows(n: int, seed: int) -> list[dict]:
    """Pairs of two answers of the toy grammar's words to one question, the one with the larger share of
    "the" chosen (``tests.helpers.grpo_rewards.word_share``'s rule, which the reward model is to learn)."""
    import random

    from tests.helpers.grpo_rewards import WORD, word_share
    from tests.helpers.tiny_chat import exchange

    rng = random.Random(seed)
    words = sorted({w for _ in range(50) for w in " ".join(exchange(rng)).split() if w != WORD})

    def answer() -> str:
        share = rng.random()
        return " ".join(WORD if rng.random() < share else rng.choice(words) for _ in range(rng.randint(1, 8)))

    rows: list[dict] = []
    while len(rows) < n:
        question, _ = exchange(rng)
        a, b = answer(), answer()
        share_a, share_b = word_share([a, b])
        if abs(share_a - share_b) >= 0.2:
            good, bad = (a, b) if share_a > share_b else (b, a)
            rows.append({"prompt": [{"role": "user", "content": question}],
                         "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
    return rows


def test_grpo_learns_from_a_reward_model_this_task_exported(tmp_path, prompts):  # noqa: F811
    """The issue's last "must show": a reward model trained here on a toy rule (prefer the answer with more
    "the" in it) is ``task=grpo``'s reward as ``{reward_model: <export>}``, scored by the one scorer
    (``scorer.RewardScorer``) and logged as ``train/rewards/judge/mean``, and the policy's reward rises (the
    rule's own measure, ``word_share`` at weight 0, with it)."""
    base = make_tiny_chat_llama(tmp_path / "base", hidden=32, layers=1)
    write_jsonl(tmp_path / "pairs.jsonl", the_rows(320, seed=0))
    write_jsonl(tmp_path / "pairs_val.jsonl", the_rows(40, seed=1))
    judge = tmp_path / "judge"
    run_in_process(compose_config(
        "task=reward_model", f"task.config={base}", f"task.data_files.train={tmp_path / 'pairs.jsonl'}",
        f"task.data_files.validation={tmp_path / 'pairs_val.jsonl'}", "task.block_size=64",
        f"task.cache_dir={tmp_path / 'cache'}", "trainer.batch_size=16", "trainer.max_epochs=3", "optim.lr=3e-3",
        "trainer.eval_every_n_steps=20", *QUIET, f"hydra.run.dir={judge}"), judge)
    accuracy = [r["eval/accuracy"] for r in metrics_rows(judge) if "eval/accuracy" in r]
    print("reward model eval/accuracy:", accuracy)  # for the record (pytest -s)
    assert max(accuracy) >= 0.9

    run = tmp_path / "grpo"
    run_in_process(compose_config(
        *prompts, f"task.rewards=[{{reward_model: {judge / 'model'}, name: judge}}, "
        f"{{_target_: {GRPO_REWARDS}.word_share, weight: 0.0}}]", "task.num_generations=8",
        "task.max_completion_length=8", "trainer.batch_size=4", "trainer.max_steps=60", "trainer.max_epochs=-1",
        "trainer.log_every_n_steps=5", "trainer.eval_every_n_steps=60", "optim.lr=1e-2", "scheduler=constant",
        f"hydra.run.dir={run}"), run)
    trained = [r for r in metrics_rows(run) if "train/rewards/judge/mean" in r]
    judged = [round(r["train/rewards/judge/mean"], 3) for r in trained]
    shares = [round(r["train/rewards/word_share/mean"], 3) for r in trained]
    print("grpo train/rewards/judge/mean:", judged, "word_share:", shares)
    assert len(trained) == 12
    assert [r["train/reward"] for r in trained] == pytest.approx([r["train/rewards/judge/mean"] for r in trained])
    assert judged[-1] > judged[0] + 1
    assert shares[0] < 0.05 and max(shares[-3:]) > 0.1  # the rule the reward model learnt: more "the"
    evaluated = [r for r in metrics_rows(run) if "eval/reward" in r]
    assert [r["step"] for r in evaluated] == [60] and "eval/rewards/judge/mean" in evaluated[0]
