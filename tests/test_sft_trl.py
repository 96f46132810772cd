"""``task=sft`` against TRL's ``SFTTrainer`` (installed as a test-only conformance reference, as
``accelerate`` is): on the same tiny model, tokenizer and data, TRL's tokenization gives the same
token ids and the same learnt-token mask as ours, and the first batch's loss agrees within 1e-5.

TRL needs ``{% generation %}`` markers in the template for ``assistant_only_loss``; ours finds the spans
without them: TRL gets ChatML with markers, we get the plain ChatML that renders the same text.
Differences in TRL's defaults, shown here: for prompt/completion *messages*, TRL's completion mask
(``completion_only_loss``, its default for such data) also learns the newline the template writes after
``<|im_end|>``; we learn the end-of-turn token and stop there, as for conversations.
"""

from __future__ import annotations

import pytest
import torch

from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.sft.config import DataFormat, TrainOn
from app.tasks.sft.packing import SFTCollator
from app.tasks.sft.task import SFTTask
from tests.helpers.tiny_chat import conversations, make_tokenizer
from tests.test_sft import encode, recipe

trl = pytest.importorskip("trl", reason="trl (the test-only conformance reference of task=sft) is not installed")

CHATML_WITH_MARKERS = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval()


def trl_trainer(tmp_path, tokenizer, rows, **options):
    import datasets
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], per_device_train_batch_size=len(rows),
                     max_length=1024, use_cpu=True, **options)
    return SFTTrainer(model=tiny_model(tokenizer), args=args, train_dataset=datasets.Dataset.from_list(rows),
                      processing_class=tokenizer)


def trl_labels(trainer) -> tuple[list[list[int]], list[list[int]]]:
    """TRL's tokenized rows: token ids and labels (its masks folded in: -100 where not learnt)."""
    return trainer.train_dataset["input_ids"], trainer.train_dataset["labels"]


def first_batch_losses(trainer, tokenizer, ours: dict[str, list]) -> tuple[float, float]:
    """TRL's loss on its first batch (its collator, its compute_loss) and ours on the same rows."""
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    model = trainer.model.eval()
    with torch.no_grad():
        theirs = float(trainer.compute_loss(model, trl_batch))
        task = object.__new__(SFTTask)
        task._explicit_mask = False
        rows = [{"input_ids": i, "labels": lab} for i, lab in zip(ours["input_ids"], ours["labels"], strict=True)]
        mine = float(SFTTask.step(task, model, SFTCollator(tokenizer.eos_token_id)(rows)).mean_loss())
    return theirs, mine


def test_conversations_give_trls_assistant_only_mask_and_first_loss(tmp_path):
    chats = conversations(8, seed=11)
    ours = encode(make_tokenizer(), [{"messages": c} for c in chats], recipe(DataFormat.messages, TrainOn.assistant))
    trainer = trl_trainer(tmp_path, make_tokenizer(CHATML_WITH_MARKERS), [{"messages": c} for c in chats],
                          assistant_only_loss=True)
    ids, labels = trl_labels(trainer)
    assert ids == ours["input_ids"]
    assert labels == ours["labels"]
    assert all(IGNORE_INDEX in row and any(t != IGNORE_INDEX for t in row) for row in labels)  # prompts masked
    theirs, mine = first_batch_losses(trainer, make_tokenizer(), ours)
    assert mine == pytest.approx(theirs, abs=1e-5)


def test_string_prompt_completion_gives_trls_completion_mask_and_first_loss(tmp_path):
    chats = conversations(8, seed=12, max_turns=1)
    rows = [{"prompt": c[-2]["content"], "completion": " " + c[-1]["content"]} for c in chats]
    tokenizer = make_tokenizer(None)
    ours = encode(tokenizer, rows, recipe(DataFormat.prompt_completion, TrainOn.completion))
    trainer = trl_trainer(tmp_path, make_tokenizer(None), rows, completion_only_loss=True)
    ids, labels = trl_labels(trainer)
    assert ids == ours["input_ids"]
    assert labels == ours["labels"]
    assert all(IGNORE_INDEX in row and any(t != IGNORE_INDEX for t in row) for row in labels)  # prompts masked
    theirs, mine = first_batch_losses(trainer, tokenizer, ours)
    assert mine == pytest.approx(theirs, abs=1e-5)


def test_prompt_completion_messages_differ_from_trl_by_the_newline_after_the_end_of_turn(tmp_path):
    chats = conversations(6, seed=13, max_turns=2)
    rows = [{"prompt": c[:-1], "completion": c[-1:]} for c in chats]
    ours = encode(make_tokenizer(), rows, recipe(DataFormat.prompt_completion, TrainOn.completion))
    trainer = trl_trainer(tmp_path, make_tokenizer(), rows, completion_only_loss=True)
    ids, labels = trl_labels(trainer)
    tokenizer = make_tokenizer()
    newline = tokenizer.convert_tokens_to_ids("Ċ")  # byte-level BPE's "\n"
    assert ids == ours["input_ids"]
    for theirs, mine in zip(labels, ours["labels"], strict=True):
        assert theirs[:-1] == mine[:-1] and mine[-1] == IGNORE_INDEX and theirs[-1] == newline
