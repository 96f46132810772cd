"""``task=kto`` as a user runs it (``python -m app``): the KL estimate z is the optimizer step's, so one
SGD step is the same at batch 8, at batch 2 × 4 accumulation steps and at batch 4 on each of 2 FSDP2
processes (within 1e-5 of the update's norm), answers of very different lengths and a reference that is
not the policy (z above 0, and the same in the three logs); a streamed file with a precomputed reference
(the KL sequences' values in its table) stopped mid-run and resumed ends as the uninterrupted run;
LoRA with the adapters off as the reference in bf16 trains, exports and is evaluated by ``mode=eval``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_app
from tests.helpers.dpo_pairs import kto_rows
from tests.helpers.metrics_rows import metrics_rows
from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")


def weights(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    tensors = load_file(path)
    return torch.cat([tensors[k].double().flatten() for k in sorted(tensors)])


def saved_model(folder: Path, seed: int, noise: float = 0.0) -> Path:
    """A tiny chat Llama with weights on disk (seed 0), moved by ``noise`` drawn from ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    make_tiny_chat_llama(folder, hidden=16, layers=1, heads=2, kv_heads=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=generator))
    model.save_pretrained(folder)
    return folder


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_one_sgd_step_is_the_same_at_batch_8_2_x_4_and_on_2_processes(tmp_path):
    from app.engine.run import run as run_in_process
    from tests.conftest import compose_config

    policy = saved_model(tmp_path / "policy", seed=0)
    reference = saved_model(tmp_path / "reference", seed=3, noise=0.05)
    rows = kto_rows(8, seed=2)
    for row in rows[4:]:  # long answers: several sentences
        row["completion"] = [{"role": "assistant", "content": " ".join([row["completion"][0]["content"]] * 4)}]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    args = ("task=kto", f"task.model={policy}", f"task.reference={reference}", f"task.data_files.train={train}",
            f"task.data_files.validation={train}", f"task.cache_dir={tmp_path / 'cache'}", "optim=sgd", "optim.lr=0.5",
            "optim.momentum=0.0", "scheduler=constant", "trainer.max_grad_norm=null", "trainer.max_steps=1",
            "task.beta=0.5", "task.desirable_weight=1.5", "checkpoint.every_epoch=false", "checkpoint.export=last",
            "early_stopping.patience=null", *QUIET)
    start = weights(policy / "model.safetensors")
    updates, logged = {}, {}
    for name, (batch, accumulation) in {"8": (8, 1), "2x4": (2, 4)}.items():
        run = tmp_path / name
        run_in_process(compose_config(*args, f"trainer.batch_size={batch}",
                                      f"trainer.gradient_accumulation_steps={accumulation}", f"hydra.run.dir={run}"), run)
    run_app(*args, "trainer.batch_size=4", "hardware=fsdp", "hardware.num_processes=2",
            f"hydra.run.dir={tmp_path / 'fsdp'}", cwd=tmp_path, check=True, timeout=240)
    for name in ("8", "2x4", "fsdp"):
        updates[name] = weights(tmp_path / name / "model" / "model.safetensors") - start
        (logged[name],) = [r for r in metrics_rows(tmp_path / name) if "train/loss" in r]
    assert updates["8"].norm() > 0 and logged["8"]["train/kl"] > 0.01
    for name in ("2x4", "fsdp"):
        assert float((updates[name] - updates["8"]).norm() / updates["8"].norm()) < 1e-5, name
        for key in ("train/loss", "train/kl", "train/rewards/chosen", "train/rewards/margins"):
            assert logged[name][key] == pytest.approx(logged["8"][key], rel=1e-5, abs=1e-7), (name, key)


def test_a_stream_with_a_precomputed_reference_resumes_exactly(tmp_path, caplog):
    """Streamed answers (each KL sequence drawn within its read-ahead) with the reference's values of the
    answers and of the KL sequences computed once and kept in checkpoints: a run stopped at step 2 and
    resumed to 4 ends with the uninterrupted run's weights and metrics, without a second reference pass."""
    from app.engine.run import run as run_in_process
    from tests.conftest import compose_config
    from tests.helpers.metrics_rows import without_throughput

    model = saved_model(tmp_path / "model", seed=0)
    train = write_jsonl(tmp_path / "train.jsonl", kto_rows(40, seed=4))
    args = ("task=kto", f"task.model={model}", f"task.data_files.train={train}", f"task.cache_dir={tmp_path / 'cache'}",
            "task.streaming=true", "task.eval_documents=8", "task.reference=precomputed", "optim.lr=1e-2",
            "scheduler=constant", "trainer.batch_size=4", "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=2",
            "checkpoint.every_n_steps=2", "checkpoint.export=last", "early_stopping.patience=null", *QUIET)
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    with caplog.at_level("INFO"):
        run_in_process(compose_config(*args, "trainer.max_steps=4", f"hydra.run.dir={whole}"), whole)
        run_in_process(compose_config(*args, "trainer.max_steps=2", f"hydra.run.dir={stopped}"), stopped)
        passes = caplog.text.count("reference log-probabilities: one pass over")
        run_in_process(compose_config(*args, "trainer.max_steps=4", f"resume={stopped}", f"hydra.run.dir={stopped}"),
                       stopped)
    assert passes == 2 and caplog.text.count("reference log-probabilities: one pass over") == 2
    assert torch.equal(weights(whole / "model" / "model.safetensors"), weights(stopped / "model" / "model.safetensors"))
    rows = {run.name: [r for r in without_throughput(metrics_rows(run)) if r["step"] > 2] for run in (whole, stopped)}
    assert rows["whole"] == rows["stopped"] and any("train/kl" in r for r in rows["whole"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_with_the_base_as_reference_in_bf16_trains_exports_and_evaluates(tmp_path):
    """The adapters off as the reference (their KL sequences too), bf16 autocast: the first step's loss is
    the closed form 0.5 (the policy starts as its reference), the run exports, its model card names the
    objective, and ``mode=eval`` of the export measures what the export was chosen with."""
    import math

    model = saved_model(tmp_path / "model", seed=0)
    train = write_jsonl(tmp_path / "train.jsonl", kto_rows(48, seed=5))
    run = tmp_path / "run"
    run_app("task=kto", f"task.model={model}", f"task.data_files.train={train}", f"task.cache_dir={tmp_path / 'cache'}",
            "adapter=lora", "task.reference=base", "precision=bf16", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
            "trainer.eval_every_n_steps=4", "optim.lr=1e-2", f"hydra.run.dir={run}", *QUIET, cwd=tmp_path, check=True,
            timeout=240)
    logged = metrics_rows(run)
    first = next(r for r in logged if "train/loss" in r)
    assert abs(first["train/loss"] - 0.5) < 1e-3 and "train/rewards/chosen" in first
    card = (run / "model" / "README.md").read_text()
    assert "kto loss, β = 0.1" in card and "reference: base" in card
    exported = json.loads((run / "model" / "export.json").read_text())["metrics"]
    evaluation = tmp_path / "eval"
    run_app("mode=eval", f"resume={run}", f"hydra.run.dir={evaluation}", *QUIET, cwd=tmp_path, check=True, timeout=240)
    measured = json.loads((evaluation / "eval_metrics.json").read_text())["metrics"]
    for name in ("eval/loss", "eval/kl", "eval/rewards/chosen", "eval/logps/rejected"):
        assert math.isfinite(measured[name]) and measured[name] == pytest.approx(exported[name], rel=1e-4, abs=1e-5), name
