"""``task=sft`` as a user runs it (``python -m app``): a base model's tokenizer given ChatML
(``task.chat_template=chatml``), conversations in JSON Lines, packed; the run trains (eval/loss and
perplexity fall, token accuracy rises), exports a folder whose tokenizer formats exactly what training
saw and whose model answers a question through ``apply_chat_template`` + ``generate`` and stops at
``<|im_end|>``; the model card says the template and what was learnt. Bad data and an unusable template
stop the run with one sentence (exit 2). One optimizer step is the same at batch 8 and at batch 2 x 4
(the loss is per learnt token over the whole step).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app.engine.run import run as run_in_process
from tests.conftest import compose_config, run_app
from tests.helpers.tiny_chat import NO_END, conversations, make_tiny_chat_llama, write_jsonl
from tests.helpers.tiny_llama import VERBS

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sft")
    make_tiny_chat_llama(folder / "base", hidden=64, base=True)
    write_jsonl(folder / "chat.jsonl", [{"messages": c} for c in conversations(400)])
    write_jsonl(folder / "val.jsonl", [{"messages": c} for c in conversations(40, seed=7)])
    return folder


@pytest.fixture(scope="module")
def chat_run(chat_data) -> Path:
    run = chat_data / "run"
    run_app("task=sft", f"task.config={chat_data / 'base'}", "task.chat_template=chatml",
            f"task.data_files.train={chat_data / 'chat.jsonl'}", f"task.data_files.validation={chat_data / 'val.jsonl'}",
            "task.block_size=256", "task.packing=true", "trainer.max_epochs=6", "trainer.batch_size=8", "optim.lr=3e-3",
            f"task.cache_dir={chat_data / 'cache'}", *QUIET, f"hydra.run.dir={run}", cwd=chat_data, check=True,
            timeout=300)
    return run


def eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r]


def test_a_packed_run_learns_the_answers(chat_run):
    rows = eval_rows(chat_run)
    assert len(rows) == 6
    # Counted in conversations, not in the packed rows that hold them (issue 51).
    assert all(row["eval/num_samples"] == 40 for row in rows)
    card = (chat_run / "model" / "README.md").read_text()
    assert re.search(r"\| train \| 400 \(in \d+ packed rows\) \|", card), card
    assert re.search(r"\| evaluation \| 40 \(in \d+ packed rows\) \|", card), card
    first, last = rows[0], rows[-1]
    assert last["eval/loss"] < 0.7 * first["eval/loss"] and last["eval/perplexity"] < 2.5
    assert last["eval/token_accuracy"] > first["eval/token_accuracy"]


def test_the_exported_tokenizer_formats_what_training_saw(chat_run, chat_data):
    from transformers import AutoTokenizer

    from app.tasks.sft.templates import install_chat_template

    exported = AutoTokenizer.from_pretrained(chat_run / "model")
    trained = AutoTokenizer.from_pretrained(chat_data / "base")
    assert trained.chat_template is None  # a base model's tokenizer: the template is the run's
    install_chat_template(trained, "chatml", "base")
    for chat in conversations(5, seed=8):
        text = trained.apply_chat_template(chat, tokenize=False)
        assert exported.apply_chat_template(chat, tokenize=False) == text
        assert exported.apply_chat_template(chat, tokenize=True, return_dict=False) == trained(
            text, add_special_tokens=False)["input_ids"]


def test_the_export_chats_and_stops_at_the_end_of_turn(chat_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_run / "model")
    model = AutoModelForCausalLM.from_pretrained(chat_run / "model")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id
    answered = 0
    for subject in ("the cat", "a dog", "the baker"):
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": f"what did {subject} do after dinner ?"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**inputs, max_new_tokens=30, do_sample=False)
        answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
        assert answer.endswith("<|im_end|>"), answer  # learnt to stop
        answered += answer.startswith(f"{subject} {VERBS[subject]} ")
    assert answered >= 2


def test_the_model_card_and_log_say_what_was_learnt(chat_run):
    card = (chat_run / "model" / "README.md").read_text()
    assert "| chat template | chatml, saved with the tokenizer (end of turn: `<\\|im_end\\|>`) |" in card
    assert "| trained on | assistant tokens, packed |" in card
    log = (chat_run / "app.log").read_text()
    assert "data: train: 400 conversations of" in log and "packed: 400 training conversations into" in log
    # The start says the run trains every step asked for (no early stopping by default) and what model/ gets.
    assert ("early stopping: off, every step asked for is trained (early_stopping.patience=N stops after N "
            "evaluations without a better eval/loss); model/: the best evaluation by eval/loss (lowest; "
            "checkpoint.export=last: the final weights)") in log


@pytest.mark.parametrize(("rows", "expected"), [
    ([{"messages": [{"role": "user", "content": "hi"}, {"content": "hello"}]}],
     "val.jsonl has 1 bad row(s) of 4: line 2: message 2 of 'messages' has no 'role' — "),
    ([{"messages": [{"role": "user", "content": "hi"}]}],
     "val.jsonl has 1 bad row(s) of 4: line 2: it has no assistant turn to learn (task.train_on=assistant) — "),
])
def test_bad_data_stops_the_run_with_one_sentence(tmp_path, chat_data, rows, expected):
    """Tokenized by 2 processes: the refusal is the main process's, with no worker's traceback."""
    good = [{"messages": c} for c in conversations(3, seed=10)]
    bad = write_jsonl(tmp_path / "val.jsonl", [good[0], *rows, *good[1:]])
    proc = run_app("task=sft", f"task.config={chat_data / 'base'}", "task.chat_template=chatml",
                   f"task.data_files.train={chat_data / 'chat.jsonl'}", f"task.data_files.validation={bad}",
                   "task.num_proc=2", f"task.cache_dir={tmp_path / 'cache'}", *QUIET, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and last.startswith("error: ") and expected in last, last
    assert last.endswith("train on the others with task.bad_rows=skip (each then written to <run>/skipped_rows.jsonl).")


def test_train_on_completion_on_conversations_is_refused_once_the_format_is_found(tmp_path, chat_data):
    """task.format=auto finds messages: a completion to learn is none of theirs (it was accepted in silence)."""
    proc = run_app("task=sft", f"task.config={chat_data / 'base'}", "task.chat_template=chatml",
                   f"task.data_files.train={chat_data / 'chat.jsonl'}", "task.train_on=completion",
                   f"task.cache_dir={tmp_path / 'cache'}", *QUIET, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "run").exists(), proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: task.train_on=completion needs prompt/completion pairs, and {chat_data / 'chat.jsonl'} holds "
        "conversations (messages); use task.train_on=assistant (every assistant turn) or last_assistant.")


def test_an_unusable_template_stops_the_run_with_one_sentence(tmp_path, chat_data):
    template = tmp_path / "template.jinja"
    template.write_text(NO_END)
    proc = run_app("task=sft", f"task.config={chat_data / 'base'}", f"task.chat_template={template}",
                   f"task.data_files.train={chat_data / 'chat.jsonl'}", f"task.cache_dir={tmp_path / 'cache'}",
                   *QUIET, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "cannot be trained on: it ends an assistant turn with no special token" in last, last


# -- the loss is per learnt token over the whole optimizer step --------------------------------------------


def weights(path: Path) -> torch.Tensor:
    tensors = load_file(path)
    return torch.cat([tensors[k].double().flatten() for k in sorted(tensors)])


def test_one_sgd_step_is_the_same_at_batch_8_and_at_batch_2_x_4(tmp_path, chat_data):
    """Conversations of 1 and of 3 exchanges: micro-batches of 2 hold very different numbers of learnt
    tokens, yet batch 2 with 4 accumulation steps makes batch 8's update (within 1e-6 of its norm)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = make_tiny_chat_llama(tmp_path / "model", hidden=16, layers=1, heads=2, kv_heads=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).save_pretrained(model)
    chats = [c for c in conversations(60, seed=9) if len(c) in (2, 3, 6, 7)]
    short = [c for c in chats if len(c) <= 3][:4]
    long = [c for c in chats if len(c) >= 6][:4]
    train = write_jsonl(tmp_path / "train.jsonl", [{"messages": c} for c in short + long])
    args = ("task=sft", f"task.model={model}", f"task.data_files.train={train}", f"task.data_files.validation={train}",
            f"task.cache_dir={tmp_path / 'cache'}", "optim=sgd", "optim.lr=0.5", "optim.momentum=0.0",
            "scheduler=constant", "trainer.max_grad_norm=null", "trainer.max_steps=1",
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
