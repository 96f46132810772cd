"""The chunked cross-entropy of ``task=sft`` (``app/tasks/sft/chunked.py``): the same per-position losses,
argmax hits and gradients as the plain loss on the whole block's logits (within 1e-6), whatever the
chunk (dividing the length or not, longer than it), packed or padded, LoRA-adapted head included; a
model that changes its logits after its head is detected and keeps the plain loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from app.tasks.causal_lm.config import LMDataFiles
from app.tasks.causal_lm.task import token_losses
from app.tasks.sft.attention import model_inputs
from app.tasks.sft.chunked import chunking_holds, losses_from_head
from app.tasks.sft.config import SFTConfig
from app.tasks.sft.task import SFTTask
from tests.helpers.tiny_chat import make_tiny_chat_llama, make_tokenizer
from tests.test_sft import packed_batch
from tests.test_sft_engine import chat  # noqa: F401 - the fixture


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    return make_tiny_chat_llama(tmp_path_factory.mktemp("chat_llama"), hidden=32, layers=2)


def tiny_model(folder: Path) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).double().train()


def losses_and_grads(model: nn.Module, batch: dict, chunk: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    model.zero_grad()
    inputs = model_inputs(batch, False, torch.float64)
    if chunk:
        with losses_from_head(model, batch["labels"], chunk):
            out = model(**inputs, use_cache=False).logits
        losses, hits = out[..., 0], out[..., 1]
    else:
        logits = model(**inputs, use_cache=False).logits
        losses, targets = token_losses(logits, batch["labels"])
        hits = (logits.argmax(dim=-1) == targets).float()
    (losses.sum() / 100).backward()
    return losses.detach(), hits, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("chunk", [1, 7, 32, 160, 1000])
def test_the_chunked_loss_is_the_plain_one(chat_llama, chunk):
    """Per-position losses, argmax hits and every parameter's gradient within 1e-6 of the plain loss's."""
    _, batch, _, _ = packed_batch(make_tokenizer())
    model = tiny_model(chat_llama)
    plain, plain_hits, plain_grads = losses_and_grads(model, batch, 0)
    chunked, hits, grads = losses_and_grads(model, batch, chunk)
    assert chunked.shape == plain.shape
    assert (chunked - plain).abs().max() <= 1e-6
    assert torch.equal(hits, plain_hits)
    assert len(grads) == len(plain_grads)
    for g, p in zip(grads, plain_grads, strict=True):
        assert (g - p).abs().max() <= 1e-6
    assert "forward" not in model.get_output_embeddings().__dict__ or \
        model.get_output_embeddings().__dict__["forward"].targets is None  # plain again outside the call


def test_the_task_step_and_evaluation_sums_agree_chunked_and_plain(chat_llama):
    """``SFTTask.step`` / ``evaluation_sums`` with ``task.loss_chunk=16`` against ``task.loss_chunk=0``, in
    float32 as trained: the summed losses within 1e-6 relative, the head's gradient within 1e-6 of its norm."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, batch, _, _ = packed_batch(make_tokenizer())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(chat_llama))
    results = []
    for chunk in (0, 16):
        task = SFTTask(SFTConfig(config=str(chat_llama), loss_chunk=chunk, 
                                 data_files=LMDataFiles(train="unused.jsonl")))
        assert chunking_holds(model, 16)
        task._loss_chunk = chunk
        model.zero_grad()
        out = task.step(model, batch)
        out.sample_losses.sum().backward()
        with torch.no_grad():
            sums = task.evaluation_sums(model, batch)
        results.append((out.sample_losses.detach(), out.sample_items, sums,
                        model.get_output_embeddings().weight.grad.clone()))
    (plain, items, sums, grad), (chunked, chunked_items, chunked_sums, chunked_grad) = results
    assert torch.equal(items, chunked_items)
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-5)
    assert (chunked_grad - grad).norm() <= 1e-6 * grad.norm()  # float32: the sums over positions run in another order
    assert torch.equal(sums["tokens"], chunked_sums["tokens"]) and torch.equal(sums["correct"], chunked_sums["correct"])
    torch.testing.assert_close(chunked_sums["loss_sum"], sums["loss_sum"], rtol=1e-6, atol=1e-5)


def test_a_lora_adapted_head_is_chunked_too(chat_llama):
    from peft import LoraConfig, get_peft_model

    _, batch, _, _ = packed_batch(make_tokenizer())
    model = get_peft_model(tiny_model(chat_llama), LoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                              init_lora_weights=False))
    plain, _, plain_grads = losses_and_grads(model, batch, 0)
    chunked, _, grads = losses_and_grads(model, batch, 24)
    assert (chunked - plain).abs().max() <= 1e-6
    assert len(grads) == len(plain_grads) > 0
    for g, p in zip(grads, plain_grads, strict=True):
        assert (g - p).abs().max() <= 1e-6


def test_a_model_that_changes_its_logits_after_the_head_keeps_the_plain_loss(chat_llama):
    model = tiny_model(chat_llama)
    assert chunking_holds(model, 256)
    assert "forward" not in model.get_output_embeddings().__dict__  # the check leaves the head as it was
    original = type(model).forward

    class Capped(type(model)):  # type: ignore[misc]
        def forward(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            out.logits = 30 * torch.tanh(out.logits / 30)  # Gemma 2's final soft cap
            return out

    model.__class__ = Capped
    assert not chunking_holds(model, 256)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_chunked_by_16_one_sgd_step_on_ddp_and_fsdp2_is_batch_8s_update(tmp_path, chat):  # noqa: F811
    """tests/test_sft_engine.py's DDP / FSDP2 equivalence with several chunks per row (its rows are
    longer than 16 tokens): the head's forward replaced under DDP's and FSDP2's hooks changes nothing."""
    from tests.test_loss_normalisation import ONE_SGD_STEP, assert_same_updates, updates_by_split

    splits = {"batch 8": (8, 1, 1, "cpu"), "batch 4 x 2 processes": (4, 1, 2, "multi_cpu"),
              "batch 2 x 2 accumulated x 2 processes FSDP2": (2, 2, 2, "fsdp")}
    assert_same_updates(updates_by_split(tmp_path, chat, *ONE_SGD_STEP, "trainer.max_steps=1", "task.packing=false",
                                         "task.loss_chunk=16", splits=splits))
