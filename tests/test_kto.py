"""``task=kto`` in process: the first batch's loss and TRL's KTO metrics agree with ``KTOTrainer`` (TRL 1.16,
a test-only reference) within 1e-5 for ``kto`` and ``apo_zero_unpaired`` with uneven weights; at policy =
reference every answer's loss is 0.5; the reference options agree (a copy, the adapters off, values
precomputed once for the answers and their KL sequences); rows come unpaired (strings or messages) or as
pairs (one good and one bad answer each), bad ones judged by ``task.bad_rows``; each answer's KL
sequence is its prompt with another prompt's answer, drawn per split (not per batch)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from app.config import ConfigError
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.kto.answers import answer_start, partners
from app.tasks.kto.config import KTOConfig, KTOLoss
from app.tasks.kto.task import KTOTask
from app.tasks.sft.config import BadRows
from tests.helpers.dpo_pairs import kto_rows, preference_rows, tiny_model
from tests.helpers.tiny_chat import make_tiny_chat_llama, make_tokenizer, write_jsonl
from tests.test_dpo import OneProcess
from tests.test_dpo_trl import TIGHT_CHATML

BETA = 0.3
TRL_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    return make_tiny_chat_llama(tmp_path_factory.mktemp("kto") / "base")


def kto_task(tmp_path: Path, model: Path, rows: list[dict], **options) -> tuple[KTOTask, object, OneProcess]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = KTOConfig(config=str(model), cache_dir=str(tmp_path / "cache"), block_size=128, **options)
    cfg.data_files.train = str(write_jsonl(tmp_path / "feedback.jsonl", rows))
    task, runtime = KTOTask(cfg), OneProcess()
    torch.manual_seed(0)
    return task, task.build_data(runtime), runtime


def moved(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))


def test_at_policy_equal_reference_every_answer_loses_one_half(tmp_path, chat_llama):
    task, data, _ = kto_task(tmp_path, chat_llama, kto_rows(12, seed=1))
    model = task.build_model().train()
    out = task.step(model, data.collate_fn([data.train[i] for i in range(6)]))
    assert out.sample_losses.tolist() == pytest.approx([0.5] * 6, abs=1e-6)
    assert out.sample_metrics["kl"].abs().max() < 1e-6


def test_the_reference_modes_agree_on_answers_and_kl_sequences(tmp_path, chat_llama):
    """A frozen copy, LoRA's adapters off and the precomputed table give the same reference values of the
    answers and of their KL sequences (the table holds both), so the same z and loss."""
    from peft import LoraConfig, get_peft_model

    rows = kto_rows(16, seed=2)
    found = {}
    for reference in ("copy", "base", "precomputed"):
        task, data, runtime = kto_task(tmp_path / reference, chat_llama, rows, reference=reference)
        model = task.build_model()
        if reference == "base":
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        model.train()
        batch = data.collate_fn([data.train[i] for i in range(6)])
        found[reference] = torch.stack([task._reference(model, batch, which) for which in (0, 1)])
        if reference == "precomputed":
            assert runtime.registered == [task.reference] and task.reference.table.shape[1] == 2
    for other in ("base", "precomputed"):
        assert torch.allclose(found["copy"], found[other], atol=1e-5, rtol=0)


def test_pairs_are_one_good_and_one_bad_answer_and_kl_sequences_pair_other_prompts(tmp_path, chat_llama):
    """A paired file gives each pair's chosen answer (desirable) and rejected one (undesirable), tokenized
    as task=dpo's sides are; each KL sequence is an answer's prompt followed by an answer to another prompt,
    the same whatever the batch."""
    rows = preference_rows(10, seed=3)
    task, data, _ = kto_task(tmp_path / "pairs", chat_llama, rows, eval_fraction=0.2)
    from tests.test_dpo import dpo_task

    _, pairs, _ = dpo_task(tmp_path / "dpo", chat_llama, rows, eval_fraction=0.2)
    answers = sorted((tuple(r["answer_ids"]), r["label"]) for split in (data.train, data.eval) for r in split)
    expected = sorted((tuple(p[f"{side}_ids"]), int(side == "chosen")) for split in (pairs.train, pairs.eval)
                      for p in split for side in ("chosen", "rejected"))
    assert answers == expected and len(answers) == 20
    for item in data.train:
        start, kl_start = answer_start(item["answer_labels"]), answer_start(item["kl_labels"])
        prompt = item["answer_ids"][:start]
        assert item["kl_ids"][:kl_start] == prompt and kl_start == start
        tail = item["kl_ids"][kl_start:]
        owner = [other for other in data.train if other["answer_ids"][answer_start(other["answer_labels"]):] == tail]
        assert owner and all(o["answer_ids"][:answer_start(o["answer_labels"])] != prompt for o in owner)
    assert "training answers: 8 desirable, 8 undesirable" in " | ".join(task.data_summary())


def test_partners_skip_the_same_prompt_and_a_lone_answer_takes_its_own():
    prompts = [(1,), (1,), (2,), (2,), (3,), (3,)]
    chosen = partners(prompts, seed=0)
    assert all(prompts[j] != prompts[i] for i, j in enumerate(chosen))
    assert chosen == partners(prompts, seed=0) != partners(prompts, seed=1)
    assert partners([(5,)], seed=0) == [0]


def test_strings_messages_and_bad_rows(tmp_path, chat_llama):
    task, data, _ = kto_task(tmp_path / "text", chat_llama, kto_rows(8, seed=4, form="text"))
    item = data.train[0]
    tokenizer = task.tokenizer
    assert item["answer_ids"][0] == tokenizer.bos_token_id and item["answer_ids"][-1] == tokenizer.eos_token_id
    learnt = tokenizer.decode([t for t in item["answer_labels"] if t != IGNORE_INDEX])
    assert learnt.endswith(" .</s>") and "?" not in learnt and not task.conversational
    rows = kto_rows(8, seed=5)
    rows[2]["label"] = "yes"
    rows[5]["completion"] = [{"role": "user", "content": "hi"}]
    with pytest.raises(ConfigError, match="feedback.jsonl has 2 bad row\\(s\\) of 8: line 3: its 'label' is 'yes', "
                                          "not true or false; line 6: the 'completion' answer has no assistant turn"):
        kto_task(tmp_path / "bad", chat_llama, rows)
    task, data, _ = kto_task(tmp_path / "skip", chat_llama, rows, bad_rows=BadRows.skip, max_bad_fraction=0.3,
                             eval_fraction=0.2)
    assert len(data.train) + len(data.eval) == 6 and [r["line"] for r in task.skipped_rows()] == [3, 6]
    with pytest.raises(ConfigError, match="has neither 'completion' and 'label' columns nor 'chosen' and 'rejected'"):
        kto_task(tmp_path / "columns", chat_llama, [{"prompt": "a", "answer": "b", "label": True}] * 4)


def test_the_weights_that_balance_the_data_are_suggested(tmp_path, chat_llama, caplog):
    rows = kto_rows(40, seed=6, desirable_share=0.8)
    with caplog.at_level("WARNING"):
        _, data, _ = kto_task(tmp_path, chat_llama, rows, eval_fraction=0.1)
    good = sum(data.train["label"])
    bad = len(data.train) - good
    lower = bad / good
    assert f"task.desirable_weight in [{lower:.2f}, {4 / 3 * lower:.2f}]" in caplog.text
    assert f"task.undesirable_weight in [{good / bad * 3 / 4:.2f}, {good / bad:.2f}]" in caplog.text


def their_kto(tmp_path, tokenizer, rows, policy, reference, loss_type: str, weights: tuple[float, float]):
    import datasets
    from trl import KTOConfig as TRLConfig
    from trl import KTOTrainer

    args = TRLConfig(output_dir=str(tmp_path / "trl"), report_to=[], per_device_train_batch_size=len(rows), beta=BETA,
                     max_length=1024, use_cpu=True, bf16=False, loss_type=loss_type, desirable_weight=weights[0],
                     undesirable_weight=weights[1])
    trainer = KTOTrainer(model=policy, ref_model=reference, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.train()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
    return loss, {k: trainer._metrics["train"][k][-1] for k in TRL_METRICS if trainer._metrics["train"][k]}


def our_kto(tokenizer, rows, policy, reference, loss_type: str, weights: tuple[float, float]):
    """Our step on the rows TRL sees, each KL sequence built as TRL builds it: the answer's prompt with the
    previous row's answer (the batch rotated by one)."""
    from app.distributed import Accelerator
    from app.tasks.dpo.preference import PairCollator
    from app.tasks.dpo.reference import FrozenCopy
    from app.tasks.kto.answers import AnswerFields, encode_answers
    from app.tasks.sft.records import Places

    cfg = KTOConfig(config="unused", beta=BETA, loss_type=KTOLoss(loss_type), desirable_weight=weights[0],
                    undesirable_weight=weights[1])
    cfg.data_files.train = "unused.jsonl"
    task = KTOTask(cfg)
    task._tokenizer = tokenizer
    task.reference = FrozenCopy(reference, Accelerator())
    fields = AnswerFields.of(cfg, Places("feedback.jsonl", "line"))
    out = encode_answers({key: [row[key] for row in rows] for key in rows[0]}, list(range(len(rows))), tokenizer, fields)
    starts = [answer_start(labels) for labels in out["answer_labels"]]
    items = []
    for i in range(len(rows)):
        j = (i - 1) % len(rows)
        kl_ids = out["answer_ids"][i][:starts[i]] + out["answer_ids"][j][starts[j]:]
        kl_labels = [IGNORE_INDEX] * starts[i] + out["answer_labels"][j][starts[j]:]
        items.append({"answer_ids": out["answer_ids"][i], "answer_labels": out["answer_labels"][i], "kl_ids": kl_ids,
                      "kl_labels": kl_labels, "label": out["label"][i], "pair": i})
    batch = PairCollator(tokenizer.eos_token_id, sides=("answer", "kl"), per_item=("label",))(items)
    with torch.no_grad():
        losses, sums = task._answers(policy, batch)
    totals = {name: float(values.sum()) for name, values in sums.items()}
    from app.tasks.kto.loss import metrics_from_sums

    return losses.mean().item(), metrics_from_sums(totals, len(rows))


@pytest.mark.parametrize(("loss_type", "weights"), [("kto", (1.3, 0.7)), ("apo_zero_unpaired", (1.0, 1.5))])
def test_the_first_batch_agrees_with_trl(tmp_path, loss_type, weights):
    pytest.importorskip("trl", reason="trl (the test-only conformance reference of task=kto) is not installed")
    tokenizer = make_tokenizer(TIGHT_CHATML)
    rows = kto_rows(6, seed=10)
    rows[0]["label"], rows[1]["label"] = True, False  # both kinds
    reference = tiny_model(tokenizer, seed=0)
    policy = tiny_model(tokenizer, seed=0)
    generator = torch.Generator().manual_seed(5)  # a policy whose KL estimate is above 0 (not clamped)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    policy.train()
    mine = our_kto(tokenizer, rows, policy, reference, loss_type, weights)
    trl_loss, trl_metrics = their_kto(tmp_path, tokenizer, rows, copy.deepcopy(policy), copy.deepcopy(reference),
                                      loss_type, weights)
    assert abs(mine[0] - trl_loss) < 1e-5 and abs(mine[0] - 0.5) > 1e-3
    for name, value in trl_metrics.items():
        assert abs(mine[1][name] - value) < 1e-5 * max(1.0, abs(value)), (name, mine[1][name], value)
    if loss_type == "kto":
        assert mine[1]["kl"] > 0 and math.isfinite(mine[1]["kl"])
