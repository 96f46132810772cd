"""Test fixtures for ``task=dpo``: a toy preference set a tiny model can learn — the chosen answer
follows the grammar's rule (each subject has its own verb), the rejected one breaks it (another
subject's verb) — as prompt/chosen/rejected messages, strings, or implicit-prompt conversations.
Seeded, nothing downloaded; the tiny Llama and its tokenizer come from ``tests/helpers/tiny_chat.py``."""

from __future__ import annotations

import hashlib
import random

from tests.helpers.tiny_llama import OBJECTS, SUBJECTS, TAILS, VERBS


def pair(rng: random.Random) -> tuple[str, str, str]:
    subject, obj, tail = rng.choice(SUBJECTS), rng.choice(OBJECTS), rng.choice(TAILS)
    wrong = rng.choice([v for s, v in VERBS.items() if s != subject])
    return (f"what did {subject} do {tail} ?", f"{subject} {VERBS[subject]} {obj} {tail} .",
            f"{subject} {wrong} {obj} {tail} .")


def preference_rows(n: int, seed: int = 0, form: str = "messages") -> list[dict]:
    """``form``: messages (explicit prompt, message lists), text (three strings), implicit (whole
    conversations, chosen and rejected sharing the user turn), ultrafeedback (the layout of
    UltraFeedback-binarized: a string prompt, whole conversations that repeat it as their user turn, and
    columns task=dpo does not read: prompt_id, messages, score_chosen, score_rejected), string_prompt (a
    string prompt, answers as one assistant message each) or string_answers (a user message, answers as
    strings)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, good, bad = pair(rng)
        user = [{"role": "user", "content": question}]
        if form == "text":
            rows.append({"prompt": question + " ", "chosen": good, "rejected": bad})
        elif form == "ultrafeedback":
            chosen = [{"content": question, "role": "user"}, {"content": good, "role": "assistant"}]
            rows.append({"prompt": question, "prompt_id": hashlib.sha256(question.encode()).hexdigest(),
                         "chosen": chosen, "rejected": [chosen[0], {"content": bad, "role": "assistant"}],
                         "messages": chosen, "score_chosen": 8.5, "score_rejected": float(len(rows) % 7)})
        elif form == "string_prompt":
            rows.append({"prompt": question, "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
        elif form == "string_answers":
            rows.append({"prompt": user, "chosen": good, "rejected": bad})
        elif form == "implicit":
            rows.append({"chosen": [*user, {"role": "assistant", "content": good}],
                         "rejected": [*user, {"role": "assistant", "content": bad}]})
        else:
            rows.append({"prompt": user, "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
    return rows


def tiny_model(tokenizer, seed: int):
    """A tiny Llama for ``tokenizer`` (random weights from ``seed``), float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config)


def pair_batch(tokenizer, rows: list[dict]) -> dict:
    """``rows`` (prompt/chosen/rejected) as task=dpo's collated batch: chosen rows, then rejected rows."""
    from app.tasks.dpo.fit import PairFit
    from app.tasks.dpo.pairs import PairFields, encode_pairs
    from app.tasks.dpo.preference import PairCollator
    from app.tasks.sft.records import Places

    fields = PairFields("prompt", "chosen", "rejected", PairFit(1024), Places("prefs.jsonl", "line"))
    encoded = encode_pairs({key: [row[key] for row in rows] for key in rows[0]}, list(range(len(rows))), tokenizer,
                           fields)
    return PairCollator(tokenizer.eos_token_id)([{**{k: encoded[k][i] for k in encoded}, "pair": i}
                                                 for i in range(len(rows))])


def dpo_task_with(tokenizer, reference, **options):
    """``DPOTask`` as a run builds it (its checks included), its tokenizer and reference model given
    instead of loaded: a frozen copy of ``reference`` on one process in full precision."""
    from app.distributed import Accelerator
    from app.tasks.dpo.config import DPOConfig
    from app.tasks.dpo.reference import FrozenCopy
    from app.tasks.dpo.task import DPOTask

    cfg = DPOConfig(config="unused", **options)
    cfg.data_files.train = "unused.jsonl"
    task = DPOTask(cfg)
    task._tokenizer = tokenizer
    if not task.reference_free:
        task.reference = FrozenCopy(reference, Accelerator())
    return task


def kto_rows(n: int, seed: int = 0, form: str = "messages", desirable_share: float = 0.5) -> list[dict]:
    """TRL's unpaired format: each row one answer of the toy grammar and whether it is desirable (it keeps
    the subject's verb) — ``desirable_share`` of them — as messages (prompt and completion lists) or
    ``text`` (strings)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, good, bad = pair(rng)
        label = rng.random() < desirable_share
        answer = good if label else bad
        if form == "text":
            rows.append({"prompt": question + " ", "completion": answer, "label": label})
        else:
            rows.append({"prompt": [{"role": "user", "content": question}],
                         "completion": [{"role": "assistant", "content": answer}], "label": label})
    return rows
