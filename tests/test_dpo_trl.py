"""``task=dpo`` against TRL's ``DPOTrainer`` (installed as a test-only conformance reference): the same
tiny Llama, tokenizer, pairs and β; the first batch's loss and TRL's four ``rewards/*`` values (and
``logps/*``) agree within 1e-5, with a frozen reference copy and with LoRA's adapters disabled.

The template is ChatML without the newline after ``<|im_end|>``: TRL learns every token after the
prompt, so it would also learn that newline; we learn the answer up to its end-of-turn token (as
``task=sft`` does). With nothing after the end of turn, both learn the same tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from app.tasks.dpo.config import LossType
from app.tasks.dpo.fit import PairFit
from app.tasks.dpo.logps import answer_logps
from app.tasks.dpo.objectives import Terms, preference_losses
from app.tasks.dpo.pairs import PairFields, encode_pairs
from app.tasks.dpo.preference import PairCollator
from app.tasks.dpo.reference import AdaptersDisabled, FrozenCopy, logps_forward
from app.tasks.sft.records import Places
from tests.helpers.dpo_pairs import preference_rows, tiny_model
from tests.helpers.tiny_chat import make_tokenizer

trl = pytest.importorskip("trl", reason="trl (the test-only conformance reference of task=dpo) is not installed")

TIGHT_CHATML = ("{% for message in messages %}"
                "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BETA = 0.3
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def ours(tokenizer, rows, policy, reference) -> tuple[float, dict[str, float]]:
    fields = PairFields("prompt", "chosen", "rejected", PairFit(1024), Places("prefs.jsonl", "line"))
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    encoded = encode_pairs(columns, list(range(len(rows))), tokenizer, fields)
    pairs = [{**{k: encoded[k][i] for k in encoded}, "pair": i} for i in range(len(rows))]
    batch = PairCollator(tokenizer.eos_token_id)(pairs)
    logits = policy(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits
    logps, lengths = answer_logps(logits, batch["labels"])
    ref = reference(policy, batch, logps_forward)
    terms = Terms(logps.view(2, -1), ref.view(2, -1), lengths.view(2, -1), torch.zeros(len(rows)), BETA)
    losses, metrics = preference_losses(terms, (LossType.sigmoid,), (1.0,))
    return losses.mean().item(), {k: v.mean().item() for k, v in metrics.items()}


def theirs(tmp_path, tokenizer, rows, policy, ref_model, peft_config=None) -> tuple[float, dict[str, float]]:
    """TRL's first-batch loss and metrics, in float32 (TRL's default is bf16 where the CPU has it)."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], per_device_train_batch_size=len(rows),
                     beta=BETA, max_length=1024, use_cpu=True, loss_type=["sigmoid"], bf16=False)
    trainer = DPOTrainer(model=policy, ref_model=ref_model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer, peft_config=peft_config)
    if peft_config is not None:
        move_adapters(trainer.model)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.train()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
    return loss, {k: trainer._metrics["train"][k][-1] for k in METRICS}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(TIGHT_CHATML)


def test_the_first_batch_agrees_with_trl_with_a_frozen_copy(tmp_path, tokenizer):
    rows = preference_rows(6, seed=11)
    reference = tiny_model(tokenizer, seed=0)
    policy = tiny_model(tokenizer, seed=0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.train()
    from app.distributed import Accelerator

    mine = ours(tokenizer, rows, policy, FrozenCopy(reference, Accelerator()))  # one process, full precision
    trl_loss, trl_metrics = theirs(tmp_path, tokenizer, rows, copy.deepcopy(policy), copy.deepcopy(reference))
    assert abs(mine[0] - trl_loss) < 1e-5
    assert mine[0] != pytest.approx(0.6931, abs=1e-3)  # the policy moved: not the trivial ln 2
    for name in METRICS:
        assert abs(mine[1][name] - trl_metrics[name]) < 1e-5 * max(1.0, abs(trl_metrics[name])), name
    assert 0 < mine[1]["rewards/accuracies"] < 1 or mine[1]["rewards/margins"] != 0


def move_adapters(model) -> None:
    """The same adapters on both sides (peft draws lora_A from the global RNG, which TRL's set_seed moves),
    and ones that change the model (peft starts lora_B at zero: the policy would equal its base)."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


def test_the_first_batch_agrees_with_trl_with_lora_adapters_disabled(tmp_path, tokenizer):
    from peft import LoraConfig, get_peft_model

    rows = preference_rows(6, seed=12)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(tiny_model(tokenizer, seed=1), copy.deepcopy(lora))
    move_adapters(model)
    model.train()
    mine = ours(tokenizer, rows, model, AdaptersDisabled())
    trl_loss, trl_metrics = theirs(tmp_path, tokenizer, rows, tiny_model(tokenizer, seed=1), None, lora)
    assert abs(mine[0] - trl_loss) < 1e-5
    assert abs(mine[0] - 0.6931) > 1e-3
    for name in METRICS:
        assert abs(mine[1][name] - trl_metrics[name]) < 1e-5 * max(1.0, abs(trl_metrics[name])), name
