"""Small generated text datasets for ``task=text_classification``, in the formats users bring, and the
nine GLUE tasks' files in GLUE's own TSV layouts.

Each dataset is learnable from its words (a class has its own keywords; a score counts the good
words), so a few steps of a tiny model move its metrics; everything is seeded.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

FILLER = ["the", "a", "report", "says", "that", "today", "our", "team", "will", "check", "it", "again", "soon",
          "ticket", "user", "asked", "about", "their", "order", "and", "then", "nothing", "happened"]
TOPICS = {0: ["invoice", "refund", "payment"], 1: ["password", "login", "account"], 2: ["shipping", "parcel", "courier"],
          3: ["crash", "error", "bug"], 4: ["price", "discount", "offer"]}
GOOD, BAD = ["great", "fast", "helpful"], ["slow", "broken", "rude"]


def _sentence(rng: random.Random, words: list[str], length: int = 8) -> str:
    chosen = [rng.choice(FILLER) for _ in range(length)]
    for word in words:
        chosen.insert(rng.randrange(len(chosen) + 1), word)
    return " ".join(chosen) + "."


def topic_rows(n: int, seed: int, classes: int = 5) -> list[tuple[str, int]]:
    """(text, class 0..classes-1): one keyword of the class's topic in filler words."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = i % classes if i < classes else rng.randrange(classes)
        rows.append((_sentence(rng, [rng.choice(TOPICS[label])], rng.randint(4, 12)), label))
    return rows


def pair_rows(n: int, seed: int) -> list[tuple[str, str, str]]:
    """(question, answer, "yes"/"no"): yes when the answer is about the question's topic."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic = rng.randrange(len(TOPICS))
        same = i % 2 == 0
        other = topic if same else (topic + rng.randrange(1, len(TOPICS))) % len(TOPICS)
        rows.append((_sentence(rng, [rng.choice(TOPICS[topic])], 5), _sentence(rng, [rng.choice(TOPICS[other])], 6),
                     "yes" if same else "no"))
    return rows


def score_rows(n: int, seed: int) -> list[tuple[str, float]]:
    """(review, score 0-5): the more good words and the fewer bad ones, the higher."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        good, bad = rng.randint(0, 3), rng.randint(0, 3)
        words = [rng.choice(GOOD) for _ in range(good)] + [rng.choice(BAD) for _ in range(bad)]
        rows.append((_sentence(rng, words, 5), round(2.5 + (good - bad) * 5 / 6, 3)))
    return rows


def tag_rows(n: int, seed: int) -> list[tuple[str, list[str]]]:
    """(text, tags): the topics it mentions (one or two of billing, access, delivery)."""
    rng = random.Random(seed)
    names = {0: "billing", 1: "access", 2: "delivery"}
    rows = []
    for _ in range(n):
        topics = sorted(rng.sample(range(3), rng.randint(1, 2)))
        rows.append((_sentence(rng, [rng.choice(TOPICS[t]) for t in topics], 6), [names[t] for t in topics]))
    return rows


def vocabulary_text() -> list[str]:
    """Every word the generated data uses, for a tiny model's vocabulary."""
    words = FILLER + [w for ws in TOPICS.values() for w in ws] + GOOD + BAD
    symbols = " ".join(str(i) for i in range(40)) + ' " ( ) ? , .'  # write_glue_task's numbers and quotes
    return [" ".join(words) + " ."] * 3 + [symbols] + [s for s, _ in topic_rows(50, 99)]


def write_csv(path: Path, header: list[str], rows: list[tuple], delimiter: str = ",") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# -- GLUE's own layouts --------------------------------------------------------------------------------------


def _tsv(path: Path, header: list[str] | None, rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (["\t".join(header)] if header is not None else []) + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_glue_task(folder: Path, task: str, n: int = 24, seed: int = 0) -> dict[str, list]:
    """One GLUE task's train.tsv, dev.tsv (MNLI: dev_matched.tsv, dev_mismatched.tsv) and test.tsv in
    GLUE's layout (columns GLUE's files have and the task does not read included; unquoted ``"``
    in the text), under ``folder`` (e.g. ``glue_data/CoLA``). Returns each file's gold labels as the
    hub numbers them (STS-B: the scores)."""
    rng = random.Random(seed)
    gold: dict[str, list] = {}

    def texts(i: int) -> tuple[str, str]:
        return _sentence(rng, [f'"{rng.choice(FILLER)}'], 4), _sentence(rng, [str(i)], 5)

    files = {"mnli": ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv")}.get(task, ("train.tsv", "dev.tsv"))
    for name in files:
        rows, labels = [], []
        for i in range(n):
            a, b = texts(i)
            if task == "cola":
                label = i % 2
                rows.append(["gj04", str(label), "" if label else "*", a])
            elif task == "sst2":
                label = i % 2
                rows.append([a, str(label)])
            elif task == "mrpc":
                label = i % 2
                rows.append([str(label), str(1000 + i), str(2000 + i), a, b])
            elif task == "stsb":
                label = round(5 * (i % 6) / 5, 3)
                rows.append([str(i), "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", a, b,
                             f"{label:.3f}"])
            elif task == "qqp":
                label = i % 2
                rows.append([str(i), str(3 * i), str(3 * i + 1), a, b, str(label)])
            elif task == "mnli":
                label = i % 3
                name_ = ("entailment", "neutral", "contradiction")[label]
                extra = [name_] * (5 if name.startswith("dev") else 1)  # label1 (dev: label1..label5)
                rows.append([str(i), str(i), f"{i}e", "fiction", f"( {a} )", f"( {b} )", f"(ROOT {a})", f"(ROOT {b})",
                             a, b, *extra, name_])
            elif task in ("qnli", "rte"):
                label = i % 2
                rows.append([str(i), a, b, ("entailment", "not_entailment")[label]])
            else:  # wnli
                label = i % 2
                rows.append([str(i), a, b, str(label)])
            labels.append(label)
        header = GLUE_HEADERS[task]
        if task == "mnli" and name.startswith("dev"):
            header = header[:-2] + [f"label{k}" for k in range(1, 6)] + ["gold_label"]
        _tsv(folder / name, None if task == "cola" else header, rows)
        gold[name] = labels
    test_name = "test_matched.tsv" if task == "mnli" else "test.tsv"
    test_header, test_rows = GLUE_TEST_HEADERS[task], []
    for i in range(n // 2):
        a, b = texts(i)
        values = {"index": str(i), "id": str(i), "sentence": a, "question": a, "question1": a, "question2": b,
                  "sentence1": a, "sentence2": b, "#1 String": a, "#2 String": b}
        if task == "qnli":
            values["sentence"] = b
        test_rows.append([values.get(column, "x") for column in test_header])
    _tsv(folder / test_name, test_header, test_rows)
    gold[test_name] = []
    return gold


GLUE_HEADERS = {
    "cola": ["source", "label", "original", "sentence"],
    "sst2": ["sentence", "label"],
    "mrpc": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "stsb": ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
             "score"],
    "qqp": ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
    "mnli": ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
             "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"],
    "qnli": ["index", "question", "sentence", "label"],
    "rte": ["index", "sentence1", "sentence2", "label"],
    "wnli": ["index", "sentence1", "sentence2", "label"],
}
"""GLUE's labeled files' headers (CoLA's have none: these are its columns)."""
GLUE_TEST_HEADERS = {
    "cola": ["index", "sentence"],
    "sst2": ["index", "sentence"],
    "mrpc": ["index", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "stsb": ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2"],
    "qqp": ["id", "question1", "question2"],
    "mnli": ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
             "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"],
    "qnli": ["index", "question", "sentence"],
    "rte": ["index", "sentence1", "sentence2"],
    "wnli": ["index", "sentence1", "sentence2"],
}
GLUE_FOLDERS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP", "mnli": "MNLI",
                "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}
"""GLUE's download (``glue_data/<folder>``)."""
