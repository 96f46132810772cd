"""``trainer.gradient_checkpointing=true``: the same losses and gradients as without, for a Transformers
model (its own gradient_checkpointing_enable), our mean-pooling classifier and a model whose task
declares its blocks (the digits MLP); a model that can do neither is refused in one sentence. The
memory it saves is measured in bench/gradient_checkpointing.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from app.config import ConfigError
from app.engine.activation_checkpointing import enable_gradient_checkpointing
from tests.conftest import compose_config
from tests.helpers.metrics_rows import metrics_rows, without_throughput


def loss_and_grads(model: nn.Module, forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()  # dropout on: the recomputation must draw the same masks
    torch.manual_seed(0)
    loss = forward(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def same_with_and_without(model: nn.Module, task, forward) -> str:
    plain = copy.deepcopy(model)
    how = enable_gradient_checkpointing(model, task)
    loss, grads = loss_and_grads(model, forward)
    expected_loss, expected_grads = loss_and_grads(plain, forward)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == expected_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    return how


def test_transformers_models_and_declared_blocks_recompute_with_the_same_loss_and_gradients(text_model):
    transformers = pytest.importorskip("transformers")
    from app.tasks import build_task
    from app.tasks.text.mean_pooling import MeanPoolingForSequenceClassification

    class Task:
        name = "tiny"

    vocab = transformers.AutoConfig.from_pretrained(text_model).vocab_size
    batch = {"input_ids": torch.randint(5, vocab, (4, 12)), "attention_mask": torch.ones(4, 12, dtype=torch.long)}

    def classify(model: nn.Module) -> torch.Tensor:
        return nn.functional.cross_entropy(model(**batch).logits, torch.tensor([0, 1, 1, 0]))

    bert = transformers.AutoModelForSequenceClassification.from_pretrained(text_model, hidden_dropout_prob=0.3)
    assert same_with_and_without(bert, Task(), classify).startswith("BertForSequenceClassification.activation_")
    assert bert.is_activation_checkpointing
    encoder = transformers.AutoModel.from_pretrained(text_model, hidden_dropout_prob=0.3)
    pooled = MeanPoolingForSequenceClassification.from_encoder(encoder, num_labels=2)
    same_with_and_without(pooled, Task(), classify)
    assert pooled.is_activation_checkpointing  # reached the encoder's layers

    digits = build_task(compose_config().task)
    x, y = torch.rand(16, 64), torch.randint(0, 10, (16,))
    how = same_with_and_without(digits.build_model(), digits,
                                lambda model: nn.functional.cross_entropy(model(x), y))
    assert how == "torch.utils.checkpoint on the 3 block(s) the task digits declares"

    with pytest.raises(ConfigError) as refused:
        enable_gradient_checkpointing(nn.Sequential(nn.Linear(4, 4)), Task())
    assert str(refused.value) == (
        "trainer.gradient_checkpointing=true cannot recompute the activations of Sequential: it is not a Transformers "
        "model, and the task tiny declares no blocks to checkpoint (checkpoint_blocks); leave "
        "trainer.gradient_checkpointing=false.")


def test_a_run_with_gradient_checkpointing_logs_the_losses_of_one_without(tmp_path):
    from app.engine.run import run

    args = ("trainer.max_steps=10", "trainer.log_every_n_steps=5", "trainer.eval_every_n_steps=5",
            "logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")
    for name, on in (("plain", "false"), ("checkpointed", "true")):
        run(compose_config(*args, f"trainer.gradient_checkpointing={on}"), tmp_path / name)

    def logged(name: str) -> list[dict]:
        return without_throughput(metrics_rows(tmp_path / name))

    plain, checkpointed = logged("plain"), logged("checkpointed")
    assert [e["step"] for e in plain] == [e["step"] for e in checkpointed] and len(plain) == 4
    for a, b in zip(plain, checkpointed):
        assert a.keys() == b.keys()
        assert all(b[k] == pytest.approx(v, rel=1e-5, abs=1e-7) for k, v in a.items()), (a, b)
    assert Path(tmp_path / "checkpointed" / "model" / "model.safetensors").is_file()
