"""Test fixtures for ``task=dpo``: a toy preference set a tiny model can learn — the chosen answer
follows the grammar's rule (each subject has its own verb), the rejected one breaks it (another
subject's verb) — as prompt/chosen/rejected messages, strings, or implicit-prompt conversations.
Seeded, nothing downloaded; the tiny Llama and its tokenizer come from ``tests/helpers/tiny_chat.py``."""

from __future__ import annotations

import random

from tests.helpers.tiny_llama import OBJECTS, SUBJECTS, TAILS, VERBS


def pair(rng: random.Random) -> tuple[str, str, str]:
    subject, obj, tail = rng.choice(SUBJECTS), rng.choice(OBJECTS), rng.choice(TAILS)
    wrong = rng.choice([v for s, v in VERBS.items() if s != subject])
    return (f"what did {subject} do {tail} ?", f"{subject} {VERBS[subject]} {obj} {tail} .",
            f"{subject} {wrong} {obj} {tail} .")


def preference_rows(n: int, seed: int = 0, form: str = "messages") -> list[dict]:
    """``form``: messages (explicit prompt, message lists), text (three strings) or implicit (whole
    conversations, chosen and rejected sharing the user turn)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, good, bad = pair(rng)
        user = [{"role": "user", "content": question}]
        if form == "text":
            rows.append({"prompt": question + " ", "chosen": good, "rejected": bad})
        elif form == "implicit":
            rows.append({"chosen": [*user, {"role": "assistant", "content": good}],
                         "rejected": [*user, {"role": "assistant", "content": bad}]})
        else:
            rows.append({"prompt": user, "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
    return rows
