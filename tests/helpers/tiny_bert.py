"""Test fixtures for the GLUE MRPC task: a tiny BERT with its own vocabulary, and tiny GLUE TSVs.

Both are built from scratch in a few seconds, so the tests need neither the hub nor ../shared.
"""

from __future__ import annotations

import random
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.tasks.text.config import TextClassificationConfig

HEADER = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

_SUBJECTS = ["The company", "Amrozi", "The witness", "Shares of Acme", "The senator", "Police", "Analysts"]
_VERBS = ["said", "reported", "denied", "announced", "claimed", "confirmed"]
_QUOTES = [
    '"the witness"',
    '"100 percent behind" the plan',
    '"a late summer frenzy',
    "profits rose",
    "it's over",
]
_SYLLABLES = ["ka", "zor", "blat", "mi", "tren", "vo", "qua", "lis", "dor", "pex", "ul", "sha"]
_TAILS = ["on Monday.", "in 1998 for $2.5 billion.", "last month.", "before the vote.", 'to "reporters".']


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


def synthetic_pairs(n: int, seed: int = 0) -> list[tuple[int, str, str]]:
    """(label, sentence1, sentence2) rows with unbalanced, unquoted ``"`` like the real MRPC text.

    Lengths vary (0-5 tails) so truncation and padding have something to do; pseudo-words give
    the WordPiece trainer enough material for a vocabulary of several hundred entries.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = rng.randint(0, 1)
        tails = " ".join(rng.choice(_TAILS) for _ in range(rng.randint(0, 5)))
        s1 = f"{rng.choice(_SUBJECTS)} of {_pseudo_word(rng)} {rng.choice(_VERBS)} {rng.choice(_QUOTES)} {tails}"
        s2 = s1 if label else f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {_pseudo_word(rng)} #{i}."
        rows.append((label, s1.strip(), s2))
    return rows


def write_glue_tsv(path: Path, rows: list[tuple[int, str, str]], first_id: int = 100000) -> Path:
    lines = [HEADER] + [
        f"{label}\t{first_id + 2 * i}\t{first_id + 2 * i + 1}\t{s1}\t{s2}"
        for i, (label, s1, s2) in enumerate(rows)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class FakeRuntime:
    """Stand-in for the Accelerator on one process (the task sees it as a TaskRuntime); it keeps what
    the task registers for checkpointing."""

    is_main_process = True
    static_shapes = False

    def __init__(self) -> None:
        self.entered = 0
        self.checkpointed: list = []

    @contextmanager
    def main_process_first(self):
        self.entered += 1
        yield

    def register_for_checkpointing(self, *objects) -> None:
        self.checkpointed.extend(objects)


def mrpc_config(**values: object) -> TextClassificationConfig:
    """``task=glue_mrpc`` as conf/task/glue_mrpc.yaml sets it (tests/test_glue_presets.py checks that
    the YAML composes to these values), with ``values`` over it."""
    from app.tasks.text.config import TextClassificationConfig
    from app.tasks.text.glue import GlueName

    preset: dict[str, object] = {"name": "glue_mrpc", "glue": GlueName.mrpc, "dataset": "nyu-mll/glue",
                                 "dataset_config": "mrpc", "text_fields": ["sentence1", "sentence2"],
                                 "metrics": ["accuracy", "f1"]}
    return TextClassificationConfig(**{**preset, **values})  # type: ignore[arg-type]


def make_tiny_glue_tsv(
    folder: Path, n_train: int = 48, n_val: int = 16, n_test: int = 0, validation_name: str = "validation.tsv"
) -> Path:
    """GLUE-format MRPC files (unquoted text with ``"`` in it); ``dev.tsv`` via ``validation_name``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_glue_tsv(folder / "train.tsv", synthetic_pairs(n_train, seed=1))
    write_glue_tsv(folder / validation_name, synthetic_pairs(n_val, seed=2))
    if n_test:
        write_glue_tsv(folder / "test.tsv", synthetic_pairs(n_test, seed=3))
    return folder


def make_tiny_bert(folder: Path, sentences: list[str], vocab_size: int = 600, seed: int = 0,
                   dropout: float = 0.1) -> Path:
    """Build a WordPiece vocabulary from ``sentences``; save a BertTokenizerFast and a tiny random BERT
    (``dropout``: its hidden and attention dropout; 0 for a model whose training is deterministic)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    # The vocabulary is built here rather than by tokenizers' WordPieceTrainer, whose choice among
    # equally frequent merges changes from run to run (a different vocabulary each time made tests
    # that compare model outputs flaky). Whole words by frequency, then every character alone and as
    # a continuation piece, so any text of the corpus tokenizes without [UNK].
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for sentence in sentences:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(sentence)))
    chars = sorted({c for word in counts for c in word})
    pieces = SPECIAL_TOKENS + chars + ["##" + c for c in chars]
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if w not in pieces]
    vocab = pieces + words[: max(0, vocab_size - len(pieces))]
    backend = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.WordPiece()
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tokenizer = BertTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=2,
        pad_token_id=tokenizer.pad_token_id,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    # A fixed initialisation: tests that compare outputs (e.g. both orders of a pair disagreeing)
    # must not depend on whichever random weights a run happened to draw.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
    model.save_pretrained(folder)
    return folder
