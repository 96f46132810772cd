"""``task=dpo`` as a user runs it (``python -m app``): on a toy preference set (the chosen answer keeps
the grammar's subject/verb rule, the rejected one breaks it) a tiny Llama learns the preference
(``eval/rewards/accuracies`` above 0.9, monitored by early stopping), TRL's metrics are in
``metrics.jsonl``, the export loads; LoRA with ``task.reference=base`` trains and exports its adapter;
bad pairs stop the run with one sentence (exit 2); and with ``task.reference=precomputed`` on 2
processes, a run SIGKILLed mid-save and resumed ends with the uninterrupted run's weights, without
running the reference pass again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_app
from tests.helpers.dpo_pairs import preference_rows
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
    assert any("train/loss" in r for r in rows(run))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "model")
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    assert model.config.vocab_size >= len(tokenizer) and tokenizer.chat_template
    card = (run / "model" / "README.md").read_text()
    assert "sigmoid preference loss" in card and "reference: copy" in card


def test_lora_with_the_base_as_reference_trains_and_exports_its_adapter(prefs):
    run = prefs / "lora"
    run_app(*data_args(prefs), "adapter=lora", "task.reference=base", "trainer.max_steps=20", "optim.lr=1e-2",
            f"hydra.run.dir={run}", cwd=prefs, check=True, timeout=300)
    last = [r for r in rows(run) if "eval/loss" in r][-1]
    assert last["eval/rewards/margins"] > 0 and last["eval/loss"] < 0.6931
    assert (run / "model" / "adapter" / "adapter_config.json").is_file()
    proc = run_app(*data_args(prefs), "task.reference=base", "trainer.max_steps=2", f"hydra.run.dir={prefs / 'no'}",
                   cwd=prefs)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: task.reference=base is the model with its LoRA adapters disabled, and this run has none: give "
        "adapter=lora, or task.reference=copy or precomputed.")


def test_a_bad_pair_stops_the_run_with_one_sentence(prefs):
    bad = preference_rows(20)
    bad[4]["rejected"] = bad[4]["chosen"]
    write_jsonl(prefs / "bad.jsonl", bad)
    proc = run_app(*data_args(prefs), f"task.data_files.train={prefs / 'bad.jsonl'}", "task.data_files.validation=null",
                   f"hydra.run.dir={prefs / 'bad'}", cwd=prefs)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {prefs / 'bad.jsonl'} line 5: the 'chosen' and 'rejected' answers are identical.")


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("hardware", "streaming"), [("multi_cpu", False), ("fsdp", False), ("fsdp", True)])
def test_precomputed_on_two_processes_killed_and_resumed_ends_bitwise_equal(prefs, hardware, streaming):
    """Rank 0 SIGKILLs itself half-way through the second save (step 6); resumed from step 3, the run
    ends with the uninterrupted run's weights and logged values, and its log shows no reference pass.
    DDP and FSDP2 (the pass split over the processes, through the sharded policy), and FSDP2 with the
    training file streamed (the pass over each process's part of it, the values keyed by byte offset)."""
    from app.distributed.checkpoint.store import FAULT_ENV

    args = (*data_args(prefs), "task.reference=precomputed", "trainer.batch_size=4", "trainer.max_steps=9",
            "checkpoint.every_n_steps=3", "trainer.eval_every_n_steps=9", "trainer.log_every_n_steps=1",
            "checkpoint.export=last", "optim.lr=1e-3", f"task.streaming={str(streaming).lower()}",
            f"hardware={hardware}", "hardware.num_processes=2")
    name = f"{hardware}{'-streamed' if streaming else ''}"
    reference, run = prefs / f"uninterrupted-{name}", prefs / f"killed-{name}"
    whole = run_app(*args, f"hydra.run.dir={reference}", cwd=prefs, check=True)
    said = whole.stdout + whole.stderr
    assert said.count(PASS) == 1 and "split over 2 processes" in said  # the main process's log
    assert ("train: streamed from" in said) is streaming
    proc = run_app(*args, f"hydra.run.dir={run}", cwd=prefs, env={FAULT_ENV: "files:1"})
    assert proc.returncode != 0 and (proc.stdout + proc.stderr).count(PASS) == 1
    resumed = run_app(f"resume={run}", cwd=prefs, check=True)
    said = resumed.stdout + resumed.stderr
    assert "resum" in said and PASS not in said
    weights = "model/model.safetensors"
    assert (run / weights).read_bytes() == (reference / weights).read_bytes()

    def logged(folder: Path) -> list:
        return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in rows(folder)]

    assert logged(run) == logged(reference)
    final = rows(run)[-1]
    assert "eval/rewards/accuracies" in final
    # mode=eval of the last checkpoint reads the values from it too: the run's last evaluation, no pass
    evaluated = run_app(f"resume={run / 'checkpoints'}", "mode=eval", *args[:-2], f"hydra.run.dir={prefs / name}",
                        cwd=prefs, check=True)
    assert PASS not in evaluated.stdout + evaluated.stderr
    metrics = json.loads((prefs / name / "eval_metrics.json").read_text())["metrics"]
    assert {k: metrics[k] for k in final if k.startswith("eval/")} == {k: v for k, v in final.items()
                                                                       if k.startswith("eval/")}


def test_one_sgd_step_is_the_same_at_batch_8_and_at_batch_2_x_4(tmp_path):
    """Pairs of very different lengths, padded with other pairs in a batch of 8 or of 2: each pair is one
    item of the step's mean, and padding changes no pair's log-probabilities, so batch 2 with 4
    accumulation steps makes batch 8's update (within 1e-6 of its norm)."""
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
