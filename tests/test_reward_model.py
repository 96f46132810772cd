"""``task=reward_model`` in process: the loss is the formula (margins, centring); the first batch's loss and
TRL's five metrics equal TRL 1.16's ``RewardTrainer``'s (test-only reference) within 1e-5, for
conversations and plain text; a sequence's score is its last real token's, padded, packed or alone; the
padding token is one no sequence ends with; the ``margin`` column is read (0 where absent), a bad one
refused naming file and line, and carried by a stream across a resume; the scorer formats and scores a
(prompt, completion) pair as training does."""

from __future__ import annotations

import copy
import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch

from app.config import ConfigError
from app.tasks.reward_model.config import RewardModelConfig
from app.tasks.reward_model.loss import reward_losses
from app.tasks.reward_model.model import PAD_TOKEN, give_padding_token
from app.tasks.reward_model.task import RewardModelTask
from tests.helpers.dpo_pairs import preference_rows
from tests.helpers.tiny_chat import make_tiny_chat_llama, make_tokenizer, write_jsonl
from tests.test_dpo import OneProcess

METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    return make_tiny_chat_llama(tmp_path_factory.mktemp("reward_model") / "base", hidden=16, layers=1, heads=2,
                                kv_heads=1)


def rm_task(tmp_path: Path, model: Path, rows: list[dict], **options) -> tuple[RewardModelTask, object]:
    """The task on ``rows`` (training and evaluation pairs alike, in file order), its data built."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    train = write_jsonl(tmp_path / "prefs.jsonl", rows)
    options = {"packing": False, "block_size": 128, **options}
    cfg = RewardModelConfig(config=str(model), cache_dir=str(tmp_path / "cache"), **options)
    cfg.data_files.train = str(train)
    if not cfg.streaming:
        cfg.data_files.validation = str(train)
    task = RewardModelTask(cfg)
    return task, task.build_data(OneProcess())


def spread_model(task: RewardModelTask, seed: int = 0):
    """The task's model, its head scaled so that the scores spread well beyond 0."""
    torch.manual_seed(seed)
    model = task.build_model()
    with torch.no_grad():
        model.score.weight.mul_(40.0)
    return model.train()


def with_margins(rows: list[dict]) -> list[dict]:
    return [{**row, "margin": [0.0, 0.5, 1.5, -0.25][k % 4]} for k, row in enumerate(rows)]


def test_the_loss_and_metrics_are_the_formulas():
    chosen, rejected = torch.tensor([1.5, -0.25, 0.75]), torch.tensor([0.5, 0.25, 0.75])
    margin, center = torch.tensor([0.25, 0.0, 1.0]), 0.1
    losses, metrics = reward_losses(chosen, rejected, margin, center)
    for k in range(3):
        c, r, m = chosen[k].item(), rejected[k].item(), margin[k].item()
        expected = -math.log(1 / (1 + math.exp(-(c - r - m)))) + center * (c + r) ** 2
        assert losses[k].item() == pytest.approx(expected, abs=1e-6)
    assert metrics["accuracy"].tolist() == [1.0, 0.0, 0.0]  # a tie is not ahead (TRL's >)
    assert metrics["margin"].tolist() == pytest.approx([1.0, -0.5, 0.0])
    assert metrics["mean_reward"].tolist() == pytest.approx([1.0, 0.0, 0.75])
    plain, _ = reward_losses(chosen, rejected, None, 0.0)
    assert plain.tolist() == pytest.approx([-math.log(1 / (1 + math.exp(-d))) for d in (1.0, -0.5, 0.0)], abs=1e-6)


def trl_first_batch(tmp_path: Path, tokenizer, rows: list[dict], model, center: float) -> tuple[float, dict]:
    """TRL's loss and metrics on its first batch (all of ``rows``), in float32, without a step."""
    import datasets
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], per_device_train_batch_size=len(rows),
                        max_length=1024, use_cpu=True, bf16=False, center_rewards_coefficient=center)
    trainer = RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                            processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.train()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
    return loss, {k: trainer._metrics["train"][k][-1] for k in METRICS}


@pytest.mark.parametrize("form", ["messages", "text"])
def test_the_first_batch_agrees_with_trl(tmp_path, chat_llama, form):
    """The same tiny model, pairs (with margins), padding token and centring coefficient: the loss and TRL's
    accuracy, margin and mean, min and max reward of the first batch agree within 1e-5."""
    pytest.importorskip("trl", reason="trl (the test-only conformance reference) is not installed")
    rows = with_margins(preference_rows(6, seed=21, form=form))
    rows[1]["chosen"] = rows[1]["chosen"] + rows[1]["chosen"] if form == "text" else rows[1]["chosen"]  # lengths differ
    task, data = rm_task(tmp_path, chat_llama, rows, center_rewards_coefficient=0.05)
    model = spread_model(task)
    batch = data.collate_fn(list(data.train))
    out = task.step(model, batch)
    mine = task.compute_metrics(out.logits, out.labels)
    trl_loss, trl_metrics = trl_first_batch(tmp_path, task.tokenizer, rows, copy.deepcopy(model), 0.05)
    assert abs(out.mean_loss().item() - trl_loss) < 1e-5
    assert abs(mine["loss"] - trl_loss) < 1e-5
    assert not math.isclose(trl_loss, math.log(2), abs_tol=0.05)  # the scores spread: not the trivial ln 2
    for name in METRICS:
        assert abs(mine[name] - trl_metrics[name]) < 1e-5 * max(1.0, abs(trl_metrics[name])), name
    assert 0 < mine["accuracy"] < 1 and mine["min_reward"] < mine["max_reward"]


def test_a_score_is_the_last_real_tokens_padded_packed_or_alone(tmp_path, chat_llama):
    """Each side's score in a padded batch, in a packed one (several pairs per row) and alone (the model's
    own pooling of an unpadded row) is the same; the packed step gives each row its pairs' sums."""
    rows = preference_rows(10, seed=4)
    for row in rows[::3]:  # some answers much longer
        row["chosen"] = [{"role": "assistant", "content": " ".join([row["chosen"][0]["content"]] * 3)}]
    task, data = rm_task(tmp_path / "padded", chat_llama, rows)
    packed_task, packed = rm_task(tmp_path / "packed", chat_llama, rows, packing=True)
    model = spread_model(task).eval()
    padded_scores = task.scores(model, data.collate_fn(list(data.train)))
    packed_batch = packed.collate_fn([packed.train[i] for i in range(len(packed.train))])
    assert packed_batch["input_ids"].shape[0] < len(rows)  # rows of several pairs
    packed_scores = packed_task.scores(model, packed_batch)
    order = packed_batch["pair"].tolist()
    with torch.no_grad():
        for k, pair in enumerate(data.train):
            for side, name in enumerate(("chosen_ids", "rejected_ids")):
                alone = model(input_ids=torch.tensor([pair[name]])).logits[0, 0].item()
                assert padded_scores[side, k].item() == pytest.approx(alone, abs=1e-5)
                assert packed_scores[side, order.index(pair["pair"])].item() == pytest.approx(alone, abs=1e-5)
        step = packed_task.step(model, packed_batch)
        unpacked = task.step(model, data.collate_fn(list(data.train)))
    assert step.sample_items.tolist() == torch.bincount(packed_batch["pair_row"]).tolist()
    assert packed_task.compute_metrics(step.logits, step.labels) == pytest.approx(
        task.compute_metrics(unpacked.logits, unpacked.labels), abs=1e-5)


def test_the_padding_token_is_one_no_sequence_ends_with(tmp_path, chat_llama, caplog):
    """None, or the EOS (plain rows end with it), or the template's end-of-turn token: a pad of its own is
    added and said; a pad of its own is kept."""
    caplog.set_level(logging.INFO)
    tokenizer = make_tokenizer()
    give_padding_token(tokenizer, {"EOS": tokenizer.eos_token_id}, "m")
    assert tokenizer.pad_token == PAD_TOKEN and "the tokenizer of m has no padding token" in caplog.text
    tokenizer = make_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    give_padding_token(tokenizer, {"EOS": tokenizer.eos_token_id}, "m")
    assert tokenizer.pad_token == PAD_TOKEN and "pads with its EOS </s>, which ends sequences" in caplog.text
    tokenizer = make_tokenizer()
    tokenizer.pad_token = "<|start_header_id|>"
    give_padding_token(tokenizer, {"EOS": tokenizer.eos_token_id}, "m")
    assert tokenizer.pad_token == "<|start_header_id|>"
    own = make_tokenizer()
    own.pad_token = "<|im_end|>"  # ChatML's end of turn
    folder = tmp_path / "pads_with_end_of_turn"
    make_tiny_chat_llama(folder, hidden=16, layers=1, heads=2, kv_heads=1)
    own.save_pretrained(folder)
    task, _ = rm_task(tmp_path / "eot", folder, preference_rows(4))
    assert task.tokenizer.pad_token == PAD_TOKEN
    model = task.build_model()
    assert model.config.pad_token_id == task.tokenizer.pad_token_id == len(task.tokenizer) - 1
    assert model.get_input_embeddings().weight.shape[0] == len(task.tokenizer)


def test_margins_are_read_a_bad_one_refused_and_a_stream_carries_them(tmp_path, chat_llama):
    rows = with_margins(preference_rows(12, seed=5))
    del rows[3]["margin"]
    rows[7]["margin"] = None
    task, data = rm_task(tmp_path / "ok", chat_llama, rows)
    expected = [0.0 if k in (3, 7) else rows[k]["margin"] for k in range(12)]
    assert data.collate_fn(list(data.train))["margin"].tolist() == expected
    assert "with a margin ('margin')" in " | ".join(task.data_summary())
    bad = with_margins(preference_rows(6))
    bad[2]["margin"] = "high"
    with pytest.raises(ConfigError, match="prefs.jsonl has 1 bad row\\(s\\) of 6: line 3: its 'margin' is not a finite "
                                          "number \\(it is 'high'\\)"):
        rm_task(tmp_path / "bad", chat_llama, bad)
    _, streamed = rm_task(tmp_path / "stream", chat_llama, rows, streaming=True, eval_documents=2)
    stream = streamed.train
    pairs = list(stream)
    assert [p["margin"] for p in pairs] == expected[2:]
    stream.set_shard(0, 1)
    it = iter(stream)
    for _ in range(3):
        next(it)
    saved = json.loads(json.dumps(stream.state_dict()))  # a checkpoint holds it as JSON
    again = rm_task(tmp_path / "stream", chat_llama, rows, streaming=True, eval_documents=2)[1].train
    again.load_state_dict(saved)
    assert [(p["pair"], p["margin"]) for p in again] == [(p["pair"], p["margin"]) for p in pairs[3:]]


def test_the_scorer_formats_and_scores_as_training_does(tmp_path, chat_llama):
    """The export's folder read by the scorer: each (prompt, completion) pair's tokens are the training
    side's, and its score the task's, for conversations and for plain text."""
    from app.tasks.reward_model.scorer import RewardScorer

    for form in ("messages", "text"):
        rows = preference_rows(5, seed=6, form=form)
        task, data = rm_task(tmp_path / form, chat_llama, rows)
        model = spread_model(task).eval()
        folder = tmp_path / f"{form}-export"
        model.save_pretrained(folder)
        task.tokenizer.save_pretrained(folder)
        scorer = RewardScorer(folder, batch_size=2)
        prompts = [r["prompt"] for r in rows for _ in range(2)]
        completions = [r[side] for r in rows for side in ("chosen", "rejected")]
        pairs = list(data.train)
        assert scorer.token_rows(prompts, completions) == [p[f"{side}_ids"] for p in pairs
                                                           for side in ("chosen", "rejected")]
        with torch.no_grad():
            trained = task.scores(model, data.collate_fn(pairs)).T.flatten().tolist()
        assert scorer(prompts=prompts, completions=completions, other=[0] * 10) == pytest.approx(trained, abs=1e-5)
        if form == "text":  # a pair longer than the model's positions: one sentence, nothing cut
            scorer.model.config.max_position_embeddings = max(len(r) for r in scorer.token_rows(prompts, completions)) - 1
            with pytest.raises(ConfigError, match=f"^reward_model={re.escape(str(folder))} reads at most .* tokens, and a prompt with "
                                                  "its completion makes .*: give shorter prompts"):
                scorer.score(prompts, completions)


def test_options_are_checked():
    for options, why in (({"beta": 0.5}, "task.beta=0.5 does not apply to task=reward_model"),
                         ({"center_rewards_coefficient": -1.0}, "task.center_rewards_coefficient must be"),
                         ({"sample_prompts": 2}, "task.sample_prompts=2 does not apply to task=reward_model")):
        cfg = RewardModelConfig(config="x", **options)
        cfg.data_files.train = "x.jsonl"
        with pytest.raises(ConfigError, match=why):
            cfg.check()


def test_the_windows_minimum_and_maximum_are_kept_reduced_logged_and_restored():
    """``StepOutput.sample_minima``/``sample_maxima`` in the engine's logging window: folded micro-batch by
    micro-batch (a micro-batch with no real sample adds nothing), logged as they are beside the means over
    the items, and a checkpoint's per-process extremes restored on another number of processes."""
    from app.engine.window_metrics import add_sample_extremes, add_sample_metrics, as_floats, logged, restored

    class OneProcessRuntime:
        def local_for_metrics(self, values):
            return values

    acc, sums = OneProcessRuntime(), {}
    for low, high, accuracy in (([0.5, -1.0], [2.0, 0.25], [1.0, 0.0]), ([], [], []), ([0.0], [3.5], [1.0])):
        add_sample_metrics(acc, sums, {"accuracy": torch.tensor(accuracy)})
        add_sample_extremes(acc, sums, {"min_reward": torch.tensor(low)}, {"max_reward": torch.tensor(high)})
    names = tuple(sums)
    assert logged(names, tuple(float(v) for v in sums.values()), 3) == {
        "train/accuracy": pytest.approx(2 / 3), "train/min_reward": -1.0, "train/max_reward": 3.5}
    windows = [as_floats(sums), {"accuracy": 1.0, "min_reward#min": -4.0, "max_reward#max": 1.0}]
    assert restored(windows, 0, 1) == {"accuracy": 1.5, "min_reward#min": -4.0, "max_reward#max": 3.5}
