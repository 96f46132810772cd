"""``task=dpo`` as a user runs it (``python -m app``): on a toy preference set (the chosen answer keeps
the grammar's subject/verb rule, the rejected one breaks it) a tiny Llama learns the preference
(``eval/rewards/accuracies`` above 0.9, monitored by early stopping), TRL's metrics are in
``metrics.jsonl``, the export loads; LoRA with ``task.reference=base`` trains and exports its adapter
(merged, with the adapted policy's log-probabilities) and ``mode=eval`` of that export evaluates it with the
run's keys; bad pairs stop the run with one sentence (exit 2);
with ``task.reference=precomputed`` on 2 processes, a run SIGKILLed mid-save and resumed ends with the
uninterrupted run's weights, without running the reference pass again. The training metrics
(``train/rewards/*``, ``train/logps/*``) are per-pair means over the logging window: hand-computed
log-probabilities, half an evaluation's rewards over a window of two steps, the same at any batch split
and on 2 processes, in TensorBoard, and unchanged by a resume mid-window.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from tests.conftest import launch_app, run_app
from tests.helpers.dpo_pairs import preference_rows
from tests.helpers.metrics_rows import metrics_rows
from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")
PASS = "reference log-probabilities: one pass over"


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dpo_app")
    make_tiny_chat_llama(folder / "base", hidden=64)
    write_jsonl(folder / "prefs.jsonl", preference_rows(240))
    write_jsonl(folder / "val.jsonl", preference_rows(40, seed=7))
    return folder


def data_args(prefs: Path) -> tuple[str, ...]:
    return ("task=dpo", f"task.config={prefs / 'base'}", f"task.data_files.train={prefs / 'prefs.jsonl'}",
            f"task.data_files.validation={prefs / 'val.jsonl'}", "task.block_size=128",
            f"task.cache_dir={prefs / 'cache'}", *QUIET)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_learns_the_preference_and_exports(prefs):
    run = prefs / "run"
    run_app(*data_args(prefs), "trainer.max_epochs=3", "optim.lr=1e-3", "trainer.eval_every_n_steps=10",
            "early_stopping.monitor=eval/rewards/accuracies", "early_stopping.mode=max", f"hydra.run.dir={run}",
            cwd=prefs, check=True, timeout=300)
    evaluations = [r for r in rows(run) if "eval/loss" in r]
    assert len(evaluations) >= 5
    first, last = evaluations[0], evaluations[-1]
    assert last["eval/rewards/accuracies"] > 0.9
    assert last["eval/rewards/margins"] > first["eval/rewards/margins"] > 0
    assert last["eval/rewards/chosen"] > last["eval/rewards/rejected"]
    assert last["eval/loss"] < first["eval/loss"] < 0.6932
    assert {"eval/logps/chosen", "eval/logps/rejected"} <= set(last)
    trained = [r for r in rows(run) if "train/loss" in r]
    assert trained[-1]["train/rewards/accuracies"] > max(0.8, trained[0]["train/rewards/accuracies"])
    assert trained[-1]["train/rewards/margins"] > trained[0]["train/rewards/margins"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "model")
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    assert model.config.vocab_size >= len(tokenizer) and tokenizer.chat_template
    card = (run / "model" / "README.md").read_text()
    assert "sigmoid preference loss" in card and "reference: copy" in card


def test_lora_with_the_base_as_reference_trains_and_exports_its_adapter(prefs):
    """The export's merged weights (``adapter.merge_on_export``, the default) load with
    ``AutoModelForCausalLM`` and give the trained policy's log-probabilities: the base model with the
    exported adapter applied (peft), within 1e-4."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    base = make_tiny_chat_llama(prefs / "lora_base", hidden=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base)).save_pretrained(base)  # weights on disk
    run = prefs / "lora"
    run_app(*(a for a in data_args(prefs) if not a.startswith("task.config=")), f"task.model={base}", "adapter=lora",
            "task.reference=base", "trainer.max_steps=20", "optim.lr=1e-2", f"hydra.run.dir={run}", cwd=prefs,
            check=True, timeout=300)
    last = [r for r in rows(run) if "eval/loss" in r][-1]
    assert last["eval/rewards/margins"] > 0 and last["eval/loss"] < 0.6931
    assert (run / "model" / "adapter" / "adapter_config.json").is_file()
    pairs = encoded_pairs(base, prefs / "val.jsonl", prefs / "encoded")[:8]
    merged = unpadded_logps(AutoModelForCausalLM.from_pretrained(run / "model").eval(), pairs)
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "model" / "adapter").eval()
    adapted = unpadded_logps(policy, pairs)
    with policy.disable_adapter():
        before = unpadded_logps(policy, pairs)
    for side in ("chosen", "rejected"):
        assert merged[side] == pytest.approx(adapted[side], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(adapted["chosen"], before["chosen"], strict=True)) > 1e-2  # it learnt
    # mode=eval of the export, with the keys the run recorded (adapter=lora, task.reference=base): its adapters
    # on the base, as it trained, giving the metrics the export was chosen with; the same given adapter=lora again.
    exported = json.loads((run / "model" / "export.json").read_text())["metrics"]
    for source, again in ((run, ()), (run / "model", ("adapter=lora",))):
        evaluation = prefs / f"lora_eval_{source.name}"
        run_app("mode=eval", f"resume={source}", *again, f"hydra.run.dir={evaluation}", *QUIET, cwd=prefs, check=True,
                timeout=300)
        measured = json.loads((evaluation / "eval_metrics.json").read_text())["metrics"]
        assert "evaluating the adapters of" in (evaluation / "app.log").read_text()
        for name in ("eval/loss", "eval/rewards/margins", "eval/logps/chosen"):
            assert measured[name] == pytest.approx(exported[name], rel=1e-5, abs=1e-6), name
    proc = run_app(*data_args(prefs), "task.reference=base", "trainer.max_steps=2", f"hydra.run.dir={prefs / 'no'}",
                   cwd=prefs)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: task.reference=base is the model with its LoRA adapters disabled, and this run has none: give "
        "adapter=lora, or task.reference=copy, precomputed or a model folder.")
    assert not (prefs / "no").exists()  # refused at start-up: no metrics.jsonl, no tensorboard/ left behind


def test_an_ultrafeedback_binarized_file_trains(prefs):
    """UltraFeedback-binarized's layout as downloaded (a string prompt, chosen/rejected conversations that
    repeat it, prompt_id, messages and scores): it trains, the chosen answers pulling ahead."""
    write_jsonl(prefs / "ultrafeedback.jsonl", preference_rows(48, seed=3, form="ultrafeedback"))
    run = prefs / "ultrafeedback"
    run_app(*data_args(prefs), f"task.data_files.train={prefs / 'ultrafeedback.jsonl'}",
            "task.data_files.validation=null", "task.eval_fraction=0.25", "trainer.batch_size=8",
            "trainer.max_steps=12", "trainer.eval_every_n_steps=6", "optim.lr=3e-3", f"hydra.run.dir={run}",
            cwd=prefs, check=True, timeout=300)
    assert f"data: train: 48 pairs of {prefs / 'ultrafeedback.jsonl'} (conversations)" in (run / "app.log").read_text()
    evaluations = [r for r in rows(run) if "eval/loss" in r]
    assert len(evaluations) >= 2 and evaluations[-1]["eval/rewards/margins"] > 0
    assert evaluations[-1]["eval/loss"] < 0.6931


def test_a_bad_pair_stops_the_run_with_one_sentence(prefs):
    bad = preference_rows(20)
    bad[4]["rejected"] = bad[4]["chosen"]
    write_jsonl(prefs / "bad.jsonl", bad)
    proc = run_app(*data_args(prefs), f"task.data_files.train={prefs / 'bad.jsonl'}", "task.data_files.validation=null",
                   f"hydra.run.dir={prefs / 'bad'}", cwd=prefs)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {prefs / 'bad.jsonl'} has 1 bad row(s) of 20: line 5: the 'chosen' and 'rejected' answers are "
        "identical — fix them, or train on the others with task.bad_rows=skip (each then written to "
        "<run>/skipped_rows.jsonl).")


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("hardware", "streaming"), [("multi_cpu", False), ("fsdp", False), ("fsdp", True)])
def test_precomputed_on_two_processes_killed_and_resumed_ends_bitwise_equal(prefs, hardware, streaming):
    """Rank 0 SIGKILLs itself half-way through the second save (step 6); resumed from step 3, the run
    ends with the uninterrupted run's weights and logged values, and its log shows no reference pass.
    DDP and FSDP2 (the pass split over the processes, through the sharded policy), and FSDP2 with the
    training file streamed (the pass over each process's part of it, the values keyed by byte offset). Log
    lines every 2 steps: the checkpoint at step 3 holds each process's partial window (loss and training
    metrics)."""
    from app.distributed.checkpoint.store import FAULT_ENV

    args = (*data_args(prefs), "task.reference=precomputed", "trainer.batch_size=4", "trainer.max_steps=9",
            "checkpoint.every_n_steps=3", "trainer.eval_every_n_steps=9", "trainer.log_every_n_steps=2",
            "checkpoint.export=last", "optim.lr=1e-3", f"task.streaming={str(streaming).lower()}",
            f"hardware={hardware}", "hardware.num_processes=2")
    name = f"{hardware}{'-streamed' if streaming else ''}"
    reference, run = prefs / f"uninterrupted-{name}", prefs / f"killed-{name}"
    launch_app(*args, run_dir=reference)  # the uninterrupted run: the command line is the killed one's
    proc = run_app(*args, f"hydra.run.dir={run}", cwd=prefs, env={FAULT_ENV: "files:1"})
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and said.count(PASS) == 1 and "split over 2 processes" in said  # the main process's log
    assert ("train: streamed from" in said) is streaming
    resumed = run_app(f"resume={run}", cwd=prefs, check=True)
    said = resumed.stdout + resumed.stderr
    assert "resum" in said and PASS not in said
    weights = "model/model.safetensors"
    assert (run / weights).read_bytes() == (reference / weights).read_bytes()

    def logged(folder: Path) -> list:
        return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in rows(folder)]

    assert logged(run) == logged(reference)
    assert [r["step"] for r in rows(run) if "train/rewards/accuracies" in r] == [2, 4, 6, 8, 9]
    final = rows(run)[-1]
    assert "eval/rewards/accuracies" in final
    # mode=eval of the last checkpoint reads the values from it too: the run's last evaluation, no pass
    evaluated = run_app(f"resume={run / 'checkpoints'}", "mode=eval", *args[:-2], f"hydra.run.dir={prefs / name}",
                        cwd=prefs, check=True)
    assert PASS not in evaluated.stdout + evaluated.stderr
    metrics = json.loads((prefs / name / "eval_metrics.json").read_text())["metrics"]
    assert {k: metrics[k] for k in final if k.startswith("eval/")} == {k: v for k, v in final.items()
                                                                       if k.startswith("eval/")}


@pytest.mark.parametrize("loss_type", ["sigmoid", "[sigmoid,sft]"])
def test_one_sgd_step_is_the_same_at_batch_8_and_at_batch_2_x_4(tmp_path, loss_type):
    """Pairs of very different lengths, padded with other pairs in a batch of 8 or of 2: each pair is one
    item of the step's mean, and padding changes no pair's log-probabilities, so batch 2 with 4
    accumulation steps makes batch 8's update (within 1e-6 of its norm). The step's training metrics
    too: ``train/logps/*`` are the means of log-probabilities computed pair by pair without padding,
    the rewards 0 (the policy is its reference), at either split. RPO's NLL term is the mean over the
    chosen tokens of the whole step (their count totalled before the step), not of each micro-batch."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from app.engine.run import run as run_in_process
    from tests.conftest import compose_config

    def weights(path: Path) -> torch.Tensor:
        tensors = load_file(path)
        return torch.cat([tensors[k].double().flatten() for k in sorted(tensors)])

    model = make_tiny_chat_llama(tmp_path / "model", hidden=16, layers=1, heads=2, kv_heads=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).save_pretrained(model)
    pairs = preference_rows(8, seed=2)
    for row in pairs[4:]:  # long answers: several sentences
        for side in ("chosen", "rejected"):
            row[side] = [{"role": "assistant", "content": " ".join([row[side][0]["content"]] * 4)}]
    train = write_jsonl(tmp_path / "train.jsonl", pairs)
    args = ("task=dpo", f"task.model={model}", f"task.data_files.train={train}", f"task.data_files.validation={train}",
            f"task.cache_dir={tmp_path / 'cache'}", "optim=sgd", "optim.lr=0.5", "optim.momentum=0.0",
            "scheduler=constant", "trainer.max_grad_norm=null", "trainer.max_steps=1", "task.beta=0.5",
            f"task.loss_type={loss_type}",
            "checkpoint.every_epoch=false", "checkpoint.export=last", "early_stopping.patience=null", *QUIET)
    start = weights(model / "model.safetensors")
    updates = {}
    for name, (batch, accumulation) in {"8": (8, 1), "2x4": (2, 4)}.items():
        run = tmp_path / name
        run_in_process(compose_config(*args, f"trainer.batch_size={batch}",
                                      f"trainer.gradient_accumulation_steps={accumulation}", f"hydra.run.dir={run}"), run)
        updates[name] = weights(run / "model" / "model.safetensors") - start
    reference = updates["8"]
    assert reference.norm() > 0
    assert float((updates["2x4"] - reference).norm() / reference.norm()) < 1e-6
    logps = unpadded_logps(AutoModelForCausalLM.from_pretrained(model).eval(),
                           encoded_pairs(model, train, tmp_path / "encoded"))
    for name in updates:
        (row,) = [r for r in metrics_rows(tmp_path / name) if "train/loss" in r]
        assert row["train/logps/chosen"] == pytest.approx(sum(logps["chosen"]) / 8, rel=1e-5)
        assert row["train/logps/rejected"] == pytest.approx(sum(logps["rejected"]) / 8, rel=1e-5)
        assert all(abs(row[f"train/rewards/{k}"]) < 1e-6 for k in ("chosen", "rejected", "margins", "accuracies"))


def encoded_pairs(model: Path, pairs: Path, cache: Path) -> list[dict]:
    """The pairs of ``pairs`` as the task encodes them for ``model``'s tokenizer (nothing else of it)."""
    from app.tasks.dpo.config import DPOConfig
    from app.tasks.dpo.task import DPOTask

    class OneProcess:
        is_main_process, static_shapes = True, False

        def main_process_first(self):
            return contextlib.nullcontext()

        def register_for_checkpointing(self, *objects) -> None:
            pass

    cfg = DPOConfig(model=str(model), cache_dir=str(cache), packing=False)
    cfg.data_files.train, cfg.data_files.validation = str(pairs), str(pairs)
    return list(DPOTask(cfg).build_data(OneProcess()).train)


def unpadded_logps(policy, pairs: list[dict]) -> dict[str, list[float]]:
    """Each pair's chosen and rejected answer log-probabilities under ``policy``, one unpadded row at a
    time, in float64."""
    import torch

    from app.tasks.causal_lm.batches import IGNORE_INDEX

    out: dict[str, list[float]] = {"chosen": [], "rejected": []}
    with torch.no_grad():
        for pair in pairs:
            for side, values in out.items():
                ids, labels = pair[f"{side}_ids"], pair[f"{side}_labels"]
                logps = torch.log_softmax(policy(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
                values.append(sum(logps[t - 1, labels[t]].item() for t in range(1, len(ids))
                                  if labels[t] != IGNORE_INDEX))
    return out


def test_training_metrics_are_per_pair_window_means_and_resume_mid_window(tmp_path):
    """``train/rewards/*`` over a logging window of two steps on the same 8 pairs (batch 8, the training
    pairs are the evaluation pairs): the first step's rewards are 0 (the policy is its reference), the
    second's are what the evaluation after the first step measured, so the window's are half the
    evaluation's. A run stopped at step 3, mid-window, and resumed to step 4 logs the uninterrupted
    run's rows (the checkpoint holds the window's partial metric sums)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from app.engine.run import run as run_in_process
    from tests.conftest import compose_config
    from tests.helpers.metrics_rows import without_throughput

    args = (*window_args(tmp_path), "trainer.batch_size=8", "checkpoint.every_n_steps=3")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run_in_process(compose_config(*args, "trainer.max_steps=4", "logging.trackers=[tensorboard]",
                                  f"hydra.run.dir={whole}"), whole)
    rows = without_throughput(metrics_rows(whole))
    train_rows = {r["step"]: r for r in rows if "train/loss" in r}
    evaluated = {r["step"]: r for r in rows if "eval/loss" in r}
    assert sorted(train_rows) == [2, 4] and sorted(evaluated) == [1, 2, 3, 4]
    rewards = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
    assert evaluated[1]["eval/rewards/margins"] > 0 and evaluated[1]["eval/rewards/accuracies"] > 0
    for name in rewards:
        assert train_rows[2][f"train/{name}"] == pytest.approx(evaluated[1][f"eval/{name}"] / 2, rel=1e-4, abs=1e-7)
    # TensorBoard has the same values as metrics.jsonl, the log-probabilities too.
    events = EventAccumulator(str(whole / "tensorboard")).Reload()
    for name in (*rewards, "logps/chosen", "logps/rejected"):
        scalars = {e.step: e.value for e in events.Scalars(f"train/{name}")}
        assert scalars == pytest.approx({step: row[f"train/{name}"] for step, row in train_rows.items()}, rel=1e-6)

    run_in_process(compose_config(*args, "trainer.max_steps=3", f"hydra.run.dir={stopped}"), stopped)
    run_in_process(compose_config(*args, "trainer.max_steps=4", f"resume={stopped}", f"hydra.run.dir={stopped}"),
                   stopped)
    resumed = without_throughput(metrics_rows(stopped))
    # The stopped run's last line (step 3, the window's first step) stays; the rest is the whole run's.
    assert [r for r in resumed if not (r["step"] == 3 and "train/loss" in r)] == rows


def window_args(tmp_path: Path) -> tuple[str, ...]:
    """8 pairs, training on the evaluation pairs: SGD steps of every pair, an evaluation after each,
    a log line every 2 steps."""
    model = make_tiny_chat_llama(tmp_path / "model", hidden=16, layers=1, heads=2, kv_heads=1)
    train = write_jsonl(tmp_path / "train.jsonl", preference_rows(8, seed=3))
    return ("task=dpo", f"task.config={model}", f"task.data_files.train={train}", f"task.data_files.validation={train}",
            f"task.cache_dir={tmp_path / 'cache'}", "optim=sgd", "optim.lr=0.5", "optim.momentum=0.0",
            "scheduler=constant", "trainer.max_epochs=9", "trainer.log_every_n_steps=2",
            "trainer.eval_every_n_steps=1", "checkpoint.every_epoch=false", "early_stopping.patience=null", *QUIET)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("hardware", ["multi_cpu", "fsdp"])
def test_two_processes_log_the_training_metrics_of_one(tmp_path, hardware):
    """Batch 4 on each of 2 processes (DDP, FSDP2) logs the training metrics of batch 8 on one: each
    process sums its pairs' metrics, and the window's one reduce adds them up with the loss's sums."""
    from app.engine.run import run as run_in_process
    from app.launching.launch import launch  # python -m app's launch: 2 processes from its fork server
    from tests.conftest import compose_config
    from tests.helpers.metrics_rows import without_throughput

    args = (*window_args(tmp_path), "trainer.max_steps=2")
    one, two = tmp_path / "one", tmp_path / "two"
    run_in_process(compose_config(*args, "trainer.batch_size=8", f"hydra.run.dir={one}"), one)
    launch(compose_config(*args, "trainer.batch_size=4", f"hardware={hardware}", "hardware.num_processes=2",
                          f"hydra.run.dir={two}"), two)
    (expected,), (got,) = ([r for r in without_throughput(metrics_rows(run)) if "train/loss" in r] for run in (one, two))
    assert expected["train/rewards/margins"] != 0 and set(got) == set(expected)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.timeout(300)
def test_bf16_gradient_checkpointing_and_lora_train_together(prefs):
    """The engine's memory savers on task=dpo at once: bf16 autocast, gradient checkpointing, LoRA with
    the adapters disabled as the reference; the first step's loss is ln 2 (the policy starts as its
    reference) and the run trains and evaluates."""
    import math

    run = prefs / "bf16-ckpt"
    run_app(*data_args(prefs), "adapter=lora", "task.reference=base", "precision=bf16",
            "trainer.gradient_checkpointing=true", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
            "trainer.eval_every_n_steps=4", "optim.lr=1e-2", f"hydra.run.dir={run}", cwd=prefs, check=True,
            timeout=300)
    logged = rows(run)
    first = next(r for r in logged if "train/loss" in r)
    assert abs(first["train/loss"] - math.log(2)) < 1e-3  # bf16 matmuls, the same weights on both sides
    last = [r for r in logged if "eval/loss" in r][-1]
    assert math.isfinite(last["eval/loss"]) and "eval/rewards/accuracies" in last
    assert "train/rewards/margins" in first


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sweep_runs_one_dpo_job_per_beta(prefs):
    sweep = prefs / "sweep"
    run_app("-m", *data_args(prefs), "task.beta=0.1,0.5", "trainer.max_steps=2", "trainer.eval_every_n_steps=2",
            f"hydra.sweep.dir={sweep}", cwd=prefs, check=True, timeout=300)
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job, beta in zip(jobs, ("0.1", "0.5"), strict=True):
        assert f"task.beta={beta}" in (sweep / job / ".hydra" / "overrides.yaml").read_text()
        assert "eval/rewards/accuracies" in rows(sweep / job)[-1]
        assert f"β = {beta}" in (sweep / job / "model" / "README.md").read_text()
    # eval/loss scales with beta: the report says its "best" is no best model, and which metric compares.
    assert ("**Not comparable:** eval/loss does not compare across task.beta (its value changes eval/loss's "
            "scale), so the best by it is not the best model; rank by one that does: "
            "early_stopping.monitor=eval/rewards/accuracies (docs/dpo.md).") in (sweep / "sweep.md").read_text()
