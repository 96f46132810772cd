"""Test fixtures for ``task=causal_lm``: a generated corpus a tiny model can learn from, and a tiny
Llama configuration with a tokenizer built from that corpus — nothing downloaded, all seeded.

The corpus is made of short "documents" in a toy grammar (a subject, a verb, an object and a tail,
each drawn from small word lists with fixed preferences), so the next word is predictable from the
previous ones and a few steps of a 2-layer model lower the perplexity clearly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ["the cat", "a dog", "my neighbour", "the old sailor", "our teacher", "a small bird", "the baker"]
VERBS = {"the cat": "chased", "a dog": "found", "my neighbour": "painted", "the old sailor": "sold",
         "our teacher": "read", "a small bird": "carried", "the baker": "baked"}
OBJECTS = ["the red ball", "a long letter", "the garden fence", "a wooden boat", "the morning paper",
           "a tiny seed", "fresh bread"]
TAILS = ["in the rain", "before noon", "with great care", "near the river", "after dinner", "again and again"]


def document(rng: random.Random) -> str:
    """One document: 1 to 4 sentences of the toy grammar."""
    sentences = []
    for _ in range(rng.randint(1, 4)):
        subject = rng.choice(SUBJECTS)
        tail = rng.choice(TAILS) if rng.random() < 0.7 else ""
        sentences.append(f"{subject} {VERBS[subject]} {rng.choice(OBJECTS)} {tail}".strip() + " .")
    return " ".join(sentences)


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [document(rng) for _ in range(n)]


def write_text(path: Path, docs: list[str]) -> Path:
    """Plain text, one document per line."""
    path.write_text("".join(d + "\n" for d in docs), encoding="utf-8")
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def vocabulary() -> list[str]:
    words = {w for phrase in [*SUBJECTS, *VERBS.values(), *OBJECTS, *TAILS, "."] for w in phrase.split()}
    return sorted(words)


SPECIAL = ["<unk>", "<s>", "</s>"]


def make_tiny_llama(folder: Path, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    max_positions: int = 256) -> Path:
    """A config folder for ``task.config``: a tiny LlamaConfig (``config.json``, randomly initialised by
    the task) and a word-level tokenizer over :func:`vocabulary` whose every encoding starts with
    ``<s>`` (as Llama's does) and which has no padding token (as Llama's has none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", model_max_length=max_positions)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, bos_token_id=vocab["<s>"],
                         eos_token_id=vocab["</s>"], tie_word_embeddings=False)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    config.save_pretrained(folder)
    return folder
