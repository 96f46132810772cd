"""The training loop: stop decisions, logging, and the engine's independence from device names."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch

from app.config import ConfigError
from app.distributed.hardware.device import DeviceOps
from app.distributed.random import set_seed
from app.engine.build import build_accelerator, build_components, build_early_stopping
from app.engine.loop import LoopState, NoCheckpoints, fit
from app.engine.parameter_groups import freeze_parameters, parameter_groups
from app.engine.schedulers import linear_with_warmup
from app.tasks.digits.task import DigitsTask
from tests.conftest import REPO, compose_config
from tests.helpers.metrics_rows import metrics_rows, without_throughput

FAST = ["logging.trackers=[]", "logging.progress_bar=false", "trainer.batch_size=128"]


class ScriptedDigits(DigitsTask):
    """Digits, but evaluation reports a scripted accuracy sequence (and can poison the loss)."""

    def __init__(self, cfg, accuracies, nan_from_step=None):
        super().__init__(cfg)
        self.accuracies = list(accuracies)
        self.evaluations = 0
        self.nan_from_step = nan_from_step
        self.train_steps = 0

    def compute_metrics(self, logits, labels):
        metrics = super().compute_metrics(logits, labels)
        metrics["accuracy"] = self.accuracies[self.evaluations]
        self.evaluations += 1
        return metrics

    def step(self, model, batch):
        out = super().step(model, batch)
        if model.training:
            self.train_steps += 1
            if self.nan_from_step is not None and self.train_steps >= self.nan_from_step:
                out.sample_losses = out.sample_losses * math.nan
        return out


def run_fit(tmp_path: Path, task_factory, *overrides: str):
    cfg = compose_config(*FAST, *overrides)
    acc = build_accelerator(cfg, tmp_path)
    acc.init_trackers("test")
    task = task_factory(cfg.task)
    components = build_components(cfg, acc, task)
    state = fit(components, cfg, LoopState(), build_early_stopping(cfg))
    acc.end_training()
    return state, task


def test_early_stopping_stops_at_the_expected_evaluation(tmp_path):
    accuracies = [0.5, 0.7, 0.69, 0.7, 0.71, 0.6, 0.6, 0.9, 0.9, 0.9]
    state, task = run_fit(tmp_path, lambda c: ScriptedDigits(c, accuracies),
                          "trainer.max_epochs=10", "early_stopping.patience=2", "early_stopping.min_delta=0.005")
    # best 0.7 at eval 2; 0.69, 0.7 do not beat it by > 0.005: stop after eval 4.
    assert task.evaluations == 4
    assert state.epoch == 4
    assert "did not improve for 2 evaluations" in state.stop_reason


def test_nan_loss_stops_at_the_next_log_step(tmp_path):
    state, _ = run_fit(tmp_path, lambda c: ScriptedDigits(c, [0.5] * 50, nan_from_step=13),
                       "trainer.log_every_n_steps=5", "trainer.max_epochs=5")
    assert state.global_step == 15
    assert "training loss is nan at step 15" in state.stop_reason


def test_max_steps_ends_the_run_and_evaluates_the_final_weights(tmp_path):
    state, task = run_fit(tmp_path, lambda c: ScriptedDigits(c, [0.5] * 10),
                          "trainer.max_steps=7", "trainer.eval_every_n_steps=5", "logging.trackers=[]")
    assert state.global_step == 7
    assert task.evaluations == 2  # at step 5, and once more for the final weights at step 7
    assert state.last_eval_step == 7


def test_max_steps_alone_runs_across_epochs(tmp_path):
    # trainer.max_epochs=-1: max_steps decides, however many epochs that takes.
    state, _ = run_fit(tmp_path, lambda c: ScriptedDigits(c, [0.5] * 10), "trainer.max_epochs=-1",
                          "trainer.max_steps=100", "trainer.batch_size=32", "logging.trackers=[]")
    assert state.global_step == 100
    assert state.epoch >= 2  # digits' train split is ~45 batches of 32
    assert state.stop_reason == "reached trainer.max_steps (100 optimizer steps)"


def test_eval_every_n_steps_and_metrics_jsonl(tmp_path):
    cfg_overrides = ["trainer.max_steps=12", "trainer.eval_every_n_steps=4", "trainer.log_every_n_steps=3"]
    run_fit(tmp_path, lambda c: ScriptedDigits(c, [0.1, 0.2, 0.3]), *cfg_overrides)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_steps = [e["step"] for e in events if "train/loss" in e]
    eval_steps = [e["step"] for e in events if "eval/accuracy" in e]
    assert train_steps == [3, 6, 9, 12]
    assert eval_steps == [4, 8, 12]
    assert [e["eval/accuracy"] for e in events if "eval/accuracy" in e] == [0.1, 0.2, 0.3]
    assert all({"step", "epoch"} <= set(e) for e in events)
    lrs = [e["train/lr"] for e in events if "train/lr" in e]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > 0 and lrs[-1] == 0.0  # linear decay to 0 at the end


class LaggingReads(DeviceOps):
    """The CPU, but reading values later, as on a device that runs ahead of the host (CUDA, XLA):
    each read records the optimizer step (the task's training steps) at which it was started and the
    one at which its result was asked."""

    reads_lag = True

    def __init__(self, task):
        self.task = task
        self.reads: list[tuple[int, int]] = []

    def read_async(self, tensors):
        ops, started = self, self.task.train_steps

        class Later:
            def result(self):
                ops.reads.append((started, ops.task.train_steps))
                return tuple(t.item() for t in tensors)

        return Later()


def run_fit_reading_late(tmp_path: Path, task_factory, *overrides: str, checkpoints=None):
    cfg = compose_config(*FAST, *overrides)
    set_seed(cfg.seed)
    acc = build_accelerator(cfg, tmp_path)
    acc.init_trackers("test")
    task = task_factory(cfg.task)
    acc.backend.ops = lagging = LaggingReads(task)
    assert acc.reads_lag
    state = fit(build_components(cfg, acc, task), cfg, LoopState(), build_early_stopping(cfg), checkpoints)
    acc.end_training()
    return state, lagging


class SavesEveryTenSteps(NoCheckpoints):
    """A checkpoint hook that notes, where it would save (every 10 steps and every epoch's end), the
    steps whose training line metrics.jsonl holds at that moment."""

    def __init__(self, folder: Path):
        self.folder, self.seen = folder, {}

    def saves_at_step(self, step):
        return step % 10 == 0

    def note(self, state):
        rows = metrics_rows(self.folder) if (self.folder / "metrics.jsonl").exists() else []
        self.seen[state.global_step] = [row["step"] for row in rows if "train/loss" in row]

    def on_step_end(self, state, metrics):
        if self.saves_at_step(state.global_step):
            self.note(state)

    def on_epoch_end(self, state, metrics):
        self.note(state)


def test_where_reads_lag_each_training_line_is_read_a_step_later_with_the_same_values(tmp_path):
    overrides = ("trainer.max_steps=23", "trainer.log_every_n_steps=5", "trainer.eval_every_n_steps=10")
    set_seed(0)
    run_fit(tmp_path / "now", lambda c: ScriptedDigits(c, [0.5] * 5), *overrides, "seed=0")
    _, lagging = run_fit_reading_late(tmp_path / "late", lambda c: ScriptedDigits(c, [0.5] * 5), *overrides, "seed=0")
    # Each log step's read is asked for after the next optimizer step, or before the evaluation of
    # the same step (step 10, 20), or at the end of training: the unfinished window of steps 21-23
    # is logged at step 23.
    assert lagging.reads == [(5, 6), (10, 10), (15, 16), (20, 20), (23, 23)]
    # The lines are the same as where they are read at once: same steps, losses, order with the
    # evaluations (a new running sum after each read, not the old one zeroed under the reader).
    assert without_throughput(metrics_rows(tmp_path / "late")) == without_throughput(metrics_rows(tmp_path / "now"))


def test_where_reads_lag_a_checkpoint_comes_after_the_training_line_of_its_step(tmp_path):
    # digits at batch 128: 12 steps an epoch; lines every 4 steps, no evaluation before the end.
    hook = SavesEveryTenSteps(tmp_path)
    run_fit_reading_late(tmp_path, lambda c: ScriptedDigits(c, [0.5] * 5), "trainer.max_steps=24",
                         "trainer.log_every_n_steps=2", "trainer.eval_every_n_steps=100", checkpoints=hook)
    # Saves at steps 10 and 20 and at the epochs' ends (12, 24) find their own step's line written.
    assert {step: lines[-1] for step, lines in hook.seen.items()} == {10: 10, 12: 12, 20: 20, 24: 24}


def test_where_reads_lag_a_nan_loss_stops_one_step_after_its_log_step(tmp_path):
    state, _ = run_fit_reading_late(tmp_path, lambda c: ScriptedDigits(c, [0.5] * 50, nan_from_step=13),
                                    "trainer.log_every_n_steps=5", "trainer.max_epochs=5")
    assert state.global_step == 16
    assert "training loss is nan at step 15" in state.stop_reason
    assert state.non_finite_loss_step == 15


def test_engine_never_names_a_device_or_collective_backend():
    pattern = re.compile(r"\b(cuda|xla|gloo|nccl|mps)\b", re.IGNORECASE)
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in (REPO / "app" / "engine").glob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_lr_schedule_shapes():
    from app.engine.schedulers import cosine_with_warmup

    def lrs(factory, **kw):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = factory(opt, total_steps=10, **kw)
        out = []
        for _ in range(10):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    linear = lrs(linear_with_warmup, warmup_steps=2)
    assert linear[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert linear[-1] == pytest.approx(0.125) and all(a >= b for a, b in itertools.pairwise(linear[1:]))
    cosine = lrs(cosine_with_warmup, warmup_ratio=0.2)
    assert cosine[1] == pytest.approx(1.0) and cosine[-1] < 0.05


def test_weight_decay_spares_biases_and_norm_weights():
    """One AdamW step with zero gradients moves parameters by weight decay alone: matrices shrink by
    (1 - lr * wd); biases and LayerNorm weights stay as they are."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=0.5), lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    after = dict(model.named_parameters())
    assert torch.allclose(after["0.weight"], before["0.weight"] * (1 - 0.1 * 0.5))
    for name in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(after[name], before[name]), name
    assert len(parameter_groups(model, weight_decay=0.0)) == 1


def test_layer_decay_gives_lower_blocks_smaller_learning_rates():
    """A 3-block BERT classifier with layer_decay 0.5: head at lr, block k at lr/2**(3-k), embeddings
    at lr/16; the warm-up schedule scales every group alike; no-decay parameters keep their rate."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=32)
    model = BertForSequenceClassification(config)
    groups = parameter_groups(model, weight_decay=0.1, lr=1.0, layer_decay=0.5)
    rate = {id(p): g["lr"] for g in groups for p in g["params"]}
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(rate) == len(named)  # every trainable parameter, once
    expected = {
        "bert.embeddings.word_embeddings.weight": 1 / 16,
        "bert.embeddings.LayerNorm.bias": 1 / 16,
        "bert.encoder.layer.0.attention.self.query.weight": 1 / 8,
        "bert.encoder.layer.1.output.dense.bias": 1 / 4,
        "bert.encoder.layer.2.intermediate.dense.weight": 1 / 2,
        "bert.pooler.dense.weight": 1.0,
        "classifier.weight": 1.0,
    }
    for name, lr in expected.items():
        assert rate[id(named[name])] == pytest.approx(lr), name
    assert decay[id(named["bert.encoder.layer.0.attention.self.query.weight"])] == 0.1
    assert decay[id(named["bert.encoder.layer.0.attention.self.query.bias"])] == 0.0

    optimizer = torch.optim.AdamW(groups, lr=123.0)  # each group's own lr wins over the default
    scheduler = linear_with_warmup(optimizer, total_steps=10, warmup_steps=4)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([g["initial_lr"] / 4 for g in optimizer.param_groups])
    assert sorted({g["initial_lr"] for g in optimizer.param_groups}) == pytest.approx([1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0])
    optimizer.step()  # no gradients: moves nothing, but keeps the step order PyTorch expects
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1 / 16 * 2 / 4)


def test_adamw_uses_the_fused_kernel_where_the_backend_has_it(tmp_path):
    def optimizer(*overrides):
        cfg = compose_config(*FAST, *overrides)
        return build_components(cfg, build_accelerator(cfg, tmp_path)).optimizer.optimizer

    assert optimizer().defaults["fused"] is True  # CPU: fused by default
    assert not optimizer("optim.fused=false").defaults["fused"]
    assert not optimizer("optim=sgd").defaults.get("fused")  # only optim=adamw has the option


def test_frozen_parameters_get_no_gradient_and_no_optimizer_group():
    """optim.freeze=[word_embeddings] on a BERT classifier: training steps leave the embedding table
    as it was and move the rest; a pattern matching nothing, or everything, is refused."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=32)
    model = BertForSequenceClassification(config)
    assert freeze_parameters(model, ["word_embeddings"]) == ["bert.embeddings.word_embeddings.weight"]
    table = model.bert.embeddings.word_embeddings.weight
    grouped = [p for g in parameter_groups(model, weight_decay=0.1) for p in g["params"]]
    assert all(p is not table for p in grouped) and len(grouped) == len(list(model.parameters())) - 1

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=0.1), lr=0.1)
    for _ in range(2):
        loss = model(input_ids=torch.randint(0, 50, (4, 6)), labels=torch.tensor([0, 1, 0, 1])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert table.grad is None and torch.equal(table, before["bert.embeddings.word_embeddings.weight"])
    assert not torch.equal(model.classifier.weight, before["classifier.weight"])
    assert not torch.equal(model.bert.embeddings.position_embeddings.weight,
                           before["bert.embeddings.position_embeddings.weight"])

    with pytest.raises(ConfigError, match="matches none of the model's parameters"):
        freeze_parameters(BertForSequenceClassification(config), ["decoder"])
    with pytest.raises(ConfigError, match="leaves nothing to train"):
        freeze_parameters(BertForSequenceClassification(config), ["bert", "classifier"])


def test_layer_decay_needs_numbered_blocks():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="numbered blocks"):
        parameter_groups(model, weight_decay=0.0, lr=1.0, layer_decay=0.8)
    assert len(parameter_groups(model, weight_decay=0.0, lr=1.0)) == 1  # without it, one group
