"""``task.reference=<folder>`` (another model as the reference) and TR-DPO's ``task.sync_ref_every`` /
``task.sync_ref_alpha``: the folder's weights are the reference's (a model of another architecture is
refused); every N optimizer steps the reference becomes ``α·policy + (1-α)·reference``; the moved
reference is saved with every checkpoint, so a run stopped after a synchronisation and resumed ends
with the uninterrupted run's weights and metrics, which differ from a run that never synchronises."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from app.config import ConfigError
from tests.helpers.dpo_pairs import preference_rows
from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl
from tests.test_dpo import OneProcess, hand_logp


def saved_model(folder: Path, seed: int, **shape) -> Path:
    """A tiny chat Llama with weights on disk, drawn from ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    make_tiny_chat_llama(folder, **shape)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


def dpo_task(tmp_path: Path, policy: Path, rows: list[dict], **options):
    """A task=dpo task on ``rows`` whose policy starts from ``policy``'s weights, its data built."""
    from app.tasks.dpo.config import DPOConfig
    from app.tasks.dpo.task import DPOTask

    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = DPOConfig(model=str(policy), cache_dir=str(tmp_path / "cache"), block_size=128, packing=False, **options)
    cfg.data_files.train = str(write_jsonl(tmp_path / "prefs.jsonl", rows))
    task = DPOTask(cfg)
    return task, task.build_data(OneProcess()), None


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("references")
    return saved_model(root / "policy", seed=1), saved_model(root / "sft", seed=2)


def test_a_reference_folder_is_the_reference(tmp_path, models):
    policy_folder, sft = models
    rows = preference_rows(6, seed=3)
    task, data, _ = dpo_task(tmp_path, policy_folder, rows, reference=str(sft))
    model = task.build_model().train()
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(sft)
    for mine, expected in zip(task.reference.model.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine, expected) and not mine.requires_grad
    pair = data.train[0]
    out = task.step(model, data.collate_fn([pair]))
    c, r = (pair["chosen_ids"], pair["chosen_labels"]), (pair["rejected_ids"], pair["rejected_labels"])
    margin = (hand_logp(model, *c) - hand_logp(theirs, *c)) - (hand_logp(model, *r) - hand_logp(theirs, *r))
    assert out.sample_losses.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.1 * margin))), abs=1e-5)
    assert "reference: " + str(sft) in task.card_facts()["trained on"]


def test_a_reference_of_another_architecture_is_refused(tmp_path, models):
    policy_folder, _ = models
    other = saved_model(tmp_path / "wide", seed=3, hidden=64)
    task, _, _ = dpo_task(tmp_path / "run", policy_folder, preference_rows(6), reference=str(other))
    with pytest.raises(ConfigError, match="is not the policy's architecture"):
        task.build_model()


def test_sync_moves_the_reference_towards_the_policy_every_n_steps(tmp_path, models):
    policy_folder, _ = models
    task, _, _ = dpo_task(tmp_path, policy_folder, preference_rows(6), sync_ref_every=2, sync_ref_alpha=0.25)
    model = task.build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = [p.clone() for p in task.reference.model.parameters()]
    task.after_optimizer_step(model, 1)  # not a multiple of 2: unchanged
    assert all(torch.equal(a, b) for a, b in zip(before, task.reference.model.parameters(), strict=True))
    task.after_optimizer_step(model, 2)
    for old, new, trained in zip(before, task.reference.model.parameters(), model.parameters(), strict=True):
        assert torch.allclose(new, 0.75 * old + 0.25 * trained, atol=1e-6)


def sync_args(tmp_path: Path) -> tuple[str, ...]:
    model = make_tiny_chat_llama(tmp_path / "model", hidden=16, layers=1, heads=2, kv_heads=1)
    train = write_jsonl(tmp_path / "train.jsonl", preference_rows(8, seed=3))
    return ("task=dpo", f"task.config={model}", f"task.data_files.train={train}",
            f"task.data_files.validation={train}", f"task.cache_dir={tmp_path / 'cache'}", "optim=sgd", "optim.lr=0.5",
            "scheduler=constant", "trainer.max_epochs=9", "checkpoint.every_epoch=false",
            "checkpoint.export=last", "early_stopping.patience=null", "logging.trackers=[]",
            "logging.progress_bar=false", "logging.print_config=false")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_fsdp2_the_moved_reference_is_saved_in_shards_and_resumes_exactly(tmp_path):
    """FSDP2 on 2 processes: the reference is sharded like the policy, each process moves its own shards,
    and the checkpoint holds them as it holds a sharded model; stopped at step 2 and resumed to 3, the run
    ends with the uninterrupted run's weights."""
    from safetensors.torch import load_file

    from tests.conftest import run_app

    # SGD with momentum: FSDP2's optimizer state cannot be loaded back when it is empty (momentum 0)
    args = (*sync_args(tmp_path), "optim.momentum=0.9", "trainer.batch_size=2", "checkpoint.every_n_steps=2",
            "task.sync_ref_every=1", "hardware=fsdp", "hardware.num_processes=2")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run_app(*args, "trainer.max_steps=3", f"hydra.run.dir={whole}", cwd=tmp_path, check=True, timeout=240)
    run_app(*args, "trainer.max_steps=2", f"hydra.run.dir={stopped}", cwd=tmp_path, check=True, timeout=240)
    assert (stopped / "checkpoints" / "checkpoint_0" / "custom_checkpoint_0").is_dir()  # sharded, as the model
    run_app(*args, "trainer.max_steps=3", f"resume={stopped}", f"hydra.run.dir={stopped}", cwd=tmp_path, check=True,
            timeout=240)
    a, b = (load_file(run / "model" / "model.safetensors") for run in (whole, stopped))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_synced_run_resumed_after_a_sync_ends_as_the_uninterrupted_one(tmp_path):
    """SGD steps with an evaluation after each; the reference moves at steps 2 and 4; a run stopped at
    step 3 (its checkpoint holds the reference moved at step 2) and resumed to 5 ends with the weights and
    metrics of the run that never stopped, and both differ from a run whose reference never moves."""
    from safetensors.torch import load_file

    from app.engine.run import run as run_in_process
    from tests.conftest import compose_config
    from tests.helpers.metrics_rows import metrics_rows, without_throughput

    args = (*sync_args(tmp_path), "optim.momentum=0.0", "trainer.batch_size=4", "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=1",
            "checkpoint.every_n_steps=3")
    synced = (*args, "task.sync_ref_every=2", "task.sync_ref_alpha=0.5")
    runs = {name: tmp_path / name for name in ("whole", "stopped", "never")}
    run_in_process(compose_config(*synced, "trainer.max_steps=5", f"hydra.run.dir={runs['whole']}"), runs["whole"])
    run_in_process(compose_config(*synced, "trainer.max_steps=3", f"hydra.run.dir={runs['stopped']}"), runs["stopped"])
    assert any(p.name.startswith("custom_checkpoint") for p in (runs["stopped"] / "checkpoints").rglob("*"))
    run_in_process(compose_config(*synced, "trainer.max_steps=5", f"resume={runs['stopped']}",
                                  f"hydra.run.dir={runs['stopped']}"), runs["stopped"])
    run_in_process(compose_config(*args, "trainer.max_steps=5", f"hydra.run.dir={runs['never']}"), runs["never"])
    weights = {name: load_file(run / "model" / "model.safetensors") for name, run in runs.items()}
    assert all(torch.equal(weights["whole"][k], weights["stopped"][k]) for k in weights["whole"])
    assert any(not torch.equal(weights["whole"][k], weights["never"][k]) for k in weights["whole"])
    evaluations = {name: [r for r in without_throughput(metrics_rows(run)) if "eval/loss" in r]
                   for name, run in runs.items()}
    assert evaluations["stopped"][-2:] == evaluations["whole"][-2:]
    assert [len(e) for e in evaluations.values()] == [5, 5, 5]
    assert evaluations["never"][0]["eval/loss"] == evaluations["whole"][0]["eval/loss"]  # before the first sync
    assert evaluations["never"][1]["eval/loss"] != evaluations["whole"][1]["eval/loss"]  # measured after it
