"""``task=sft`` with the rest of the engine (issue 38): a real ``python -m app`` run SIGKILLed half-way
through a checkpoint save and resumed with ``resume=<run folder>`` ends with the uninterrupted run's
weights, bit for bit, and logs the same losses after the resume point (one process, and two on gloo);
one SGD step on 2 processes (DDP, and FSDP2 with accumulation) is batch 8's update on one process
although conversations of 1 and of 3 exchanges give the micro-batches very different numbers of learnt
tokens (issue 36's promise for SFT); ``precision=bf16`` with gradient checkpointing, and ``adapter=lora``,
train (finite training losses that fall) and export, and ``mode=eval`` scores the export and a
checkpoint as the run's last evaluation did.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from app.engine.run import run as run_in_process
from tests.conftest import compose_config, launch_app, run_app
from tests.helpers.metrics_rows import metrics_rows, without_throughput
from tests.helpers.tiny_chat import conversations, make_tiny_chat_llama, write_jsonl
from tests.test_loss_normalisation import ONE_SGD_STEP, assert_same_updates, updates_by_split

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> tuple[str, ...]:
    """A saved tiny Llama with ChatML (its weights start every run) and conversations of 1 and of 3
    exchanges, four of a kind in turn: micro-batches of 2 or 4 hold very different numbers of learnt tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("sft_engine")
    model = make_tiny_chat_llama(folder / "model", hidden=16, layers=1, heads=2, kv_heads=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).save_pretrained(model)
    chats = conversations(400, seed=9)
    short = [c for c in chats if len(c) in (2, 3)]
    long = [c for c in chats if len(c) in (6, 7)]
    train = [c for i in range(0, 48, 4) for c in (short[i:i + 4] if (i // 4) % 2 == 0 else long[i:i + 4])]
    write_jsonl(folder / "train.jsonl", [{"messages": c} for c in train])
    write_jsonl(folder / "val.jsonl", [{"messages": c} for c in conversations(12, seed=7)])
    return ("task=sft", f"task.model={model}", f"task.data_files.train={folder / 'train.jsonl'}",
            f"task.data_files.validation={folder / 'val.jsonl'}", f"task.cache_dir={folder / 'cache'}")


def logged(run: Path) -> list[dict]:
    return without_throughput(metrics_rows(run))


def train_losses(run: Path) -> list[float]:
    return [r["train/loss"] for r in metrics_rows(run) if "train/loss" in r]


# -- SIGKILL and exact resume -------------------------------------------------------------------------------


def killed_and_resumed(tmp_path: Path, chat: tuple[str, ...], *extra: str) -> tuple[Path, Path]:
    """An uninterrupted run of 9 AdamW steps (saves at 3, 6, 9) and the same run SIGKILLed half-way
    through writing its second save's files, then resumed from its run folder (from step 3)."""
    from app.distributed.checkpoint.store import FAULT_ENV

    args = (*chat, *QUIET, *extra, "optim.lr=3e-3", "task.packing=true", "task.block_size=128", "trainer.batch_size=2",
            "trainer.max_steps=9", "checkpoint.every_n_steps=3", "trainer.eval_every_n_steps=9",
            "trainer.log_every_n_steps=1", "checkpoint.export=last", "early_stopping.patience=null")
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    launch_app(*args, run_dir=reference)  # the uninterrupted run: the command line is the killed one's
    proc = run_app(*args, f"hydra.run.dir={killed}", cwd=tmp_path, env={FAULT_ENV: "files:1"}, timeout=300)
    assert proc.returncode != 0 and not (killed / "model").exists()
    assert max(r["step"] for r in metrics_rows(killed)) >= 6  # it had trained past the first save
    run_app(f"resume={killed}", cwd=tmp_path, check=True, timeout=300)
    return reference, killed


def assert_bitwise_equal(reference: Path, resumed: Path) -> None:
    weights = "model/model.safetensors"
    assert (resumed / weights).read_bytes() == (reference / weights).read_bytes()
    # Every logged value after the resume point (step 3) is the uninterrupted run's, the losses included.
    after = [r for r in logged(reference) if r["step"] > 3]
    assert [r for r in logged(resumed) if r["step"] > 3][-len(after):] == after
    assert len(train_losses(reference)) == 9 and all(math.isfinite(x) for x in train_losses(reference))


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_mid_save_and_resumed_ends_with_the_uninterrupted_weights(tmp_path, chat):
    assert_bitwise_equal(*killed_and_resumed(tmp_path, chat))


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_on_two_processes_killed_mid_save_and_resumed_ends_with_the_uninterrupted_weights(tmp_path, chat):
    assert_bitwise_equal(*killed_and_resumed(tmp_path, chat, "hardware=multi_cpu", "hardware.num_processes=2"))


# -- the loss is per learnt token over the step, on every engine ---------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_one_sgd_step_on_two_processes_ddp_and_fsdp2_is_batch_8s_update(tmp_path, chat):
    splits = {"batch 8": (8, 1, 1, "cpu"), "batch 4 x 2 processes": (4, 1, 2, "multi_cpu"),
              "batch 2 x 2 accumulated x 2 processes FSDP2": (2, 2, 2, "fsdp")}
    assert_same_updates(updates_by_split(tmp_path, chat, *ONE_SGD_STEP, "trainer.max_steps=1", "task.packing=false",
                                         splits=splits))


# -- precision, gradient checkpointing, LoRA; mode=eval ----------------------------------------------------


def short_run(tmp_path: Path, name: str, chat: tuple[str, ...], *extra: str,
              fall: float = 0.9) -> tuple[Path, tuple[str, ...]]:
    """8 AdamW steps at a high rate, a checkpoint at the end, the model exported; the mean of the last 3
    training losses below ``fall`` times the first 3's."""
    run = tmp_path / name
    args = (*chat, *QUIET, *extra, "scheduler=constant", "task.packing=true", "task.block_size=128",
            "trainer.batch_size=2", "trainer.max_steps=8", "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=8",
            "checkpoint.every_n_steps=8", "checkpoint.export=last", "early_stopping.patience=null")
    run_app(*args, f"hydra.run.dir={run}", cwd=tmp_path, check=True, timeout=300)
    losses = train_losses(run)
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < fall * sum(losses[:3]) / 3, losses  # it learns
    return run, args


def assert_mode_eval_matches(tmp_path: Path, run: Path, args: tuple[str, ...], *sources: Path) -> None:
    from app.distributed.checkpoint.store import complete_checkpoints

    final = [r for r in metrics_rows(run) if "eval/loss" in r][-1]
    assert math.isfinite(final["eval/loss"])
    checkpoint = Path(complete_checkpoints(run / "checkpoints")[-1][0])
    for source in (*sources, checkpoint):
        out = tmp_path / f"eval-{run.name}-{source.name}"
        out.mkdir()
        run_in_process(compose_config(*args, "mode=eval", f"resume={source}"), out)
        measured = json.loads((out / "eval_metrics.json").read_text())["metrics"]
        assert measured["eval/loss"] == pytest.approx(final["eval/loss"], rel=1e-4), source


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bf16_with_gradient_checkpointing_trains_exports_and_evaluates(tmp_path, chat):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, args = short_run(tmp_path, "bf16", chat, "optim.lr=1e-2", "precision=bf16", "trainer.gradient_checkpointing=true")
    log = (run / "app.log").read_text()
    assert "gradient checkpointing: LlamaForCausalLM." in log and "precision bf16," in log
    exported = run / "model"
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "what did the cat do ?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    assert_mode_eval_matches(tmp_path, run, args, exported)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_trains_exports_the_adapter_and_the_merged_model_and_evaluates(tmp_path, chat):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    # The head adapted too: low-rank updates of a random 16-wide model's body alone hardly move its loss.
    run, args = short_run(tmp_path, "lora", chat, "optim.lr=1e-2", "adapter=lora", "adapter.dropout=0.0",
                          "adapter.target_modules=[q_proj,v_proj,o_proj,up_proj,down_proj,lm_head]",
                          fall=0.97)
    exported = run / "model"
    assert (exported / "adapter" / "adapter_model.safetensors").is_file()
    assert (exported / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(exported)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert_mode_eval_matches(tmp_path, run, args, exported)
