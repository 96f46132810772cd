"""Test fixtures for ``task=sft``: toy conversations a tiny model can learn, a byte-level BPE tokenizer
trained on them offline (special tokens of three template families, ChatML as its own template), and
a tiny Llama configuration — nothing downloaded, all seeded.

The three template families are written here as Jinja: ChatML (the app's built-in), a Llama-3-style
header template and a Llama-2/Mistral-style ``[INST]`` template (no generation prompt, EOS after each
answer). Two unusable ones: a template that renders earlier turns differently as the conversation
grows (no prefix property) and one that ends turns with no special token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from app.tasks.sft.templates import CHATML
from tests.helpers.tiny_llama import OBJECTS, SUBJECTS, TAILS, VERBS

LLAMA3 = ("{{ bos_token }}{% for m in messages %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")
LLAMA2 = ("{{ bos_token }}{% for m in messages %}"
          "{% if m['role'] == 'system' %}{{ '<<SYS>>\\n' + m['content'] + '\\n<</SYS>>\\n\\n' }}"
          "{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
          "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
          "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "llama2": LLAMA2}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "llama2": "</s>"}
COUNTDOWN = ("{% for m in messages %}{{ (messages | length - loop.index0) | string + ' ' + m['role'] + ': ' "
             "+ m['content'] + '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}0 assistant: {% endif %}")
"""Unusable: each turn is numbered from the end, so a prefix renders differently from the whole's start."""
NO_END = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}assistant: {% endif %}")
"""Unusable: turns end with a newline, not a special token, so the model could never learn to stop."""

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BASE_SPECIAL = [t for t in SPECIAL if "im_" not in t]
SYSTEMS = ["you answer in one sentence .", "you are a helpful assistant ."]


def exchange(rng: random.Random) -> tuple[str, str]:
    """A question and its answer in the toy grammar: the answer follows from the question."""
    subject = rng.choice(SUBJECTS)
    obj = rng.choice(OBJECTS)
    tail = rng.choice(TAILS)
    return f"what did {subject} do {tail} ?", f"{subject} {VERBS[subject]} {obj} {tail} ."


def conversations(n: int, seed: int = 0, max_turns: int = 3) -> list[list[dict[str, str]]]:
    """Conversations of 1 to ``max_turns`` user/assistant exchanges, half with a system message."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, max_turns)):
            question, answer = exchange(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append(messages)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def corpus() -> list[str]:
    texts = [m["content"] for c in conversations(200, seed=99) for m in c]
    return [*texts, *TEMPLATES.values(), COUNTDOWN, NO_END, "system user assistant [INST] [/INST] <<SYS>> <</SYS>> \n\n 0 1 2 3 4 5 6 7 8 9 :"]


def make_tokenizer(template: str | None = CHATML, special: list[str] = SPECIAL):
    """A fast byte-level BPE tokenizer (exact round trip of any text), trained on :func:`corpus`, with
    the special tokens of the three families (``special``), BOS ``<s>`` before plain text, EOS ``</s>``;
    ``template`` None: no chat template (a base model's tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus(), trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        extra_special_tokens=special[2:], model_max_length=1024)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def make_tiny_chat_llama(folder: Path, template: str | None = CHATML, hidden: int = 32, layers: int = 2,
                         heads: int = 4, kv_heads: int = 2, base: bool = False) -> Path:
    """A config folder for ``task.config``: a tiny LlamaConfig and the tokenizer, ``template`` as its
    chat template. ``base``: a base model's tokenizer, with no template and none of ChatML's tokens."""
    from transformers import LlamaConfig

    tokenizer = make_tokenizer(None, BASE_SPECIAL) if base else make_tokenizer(template)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    config.save_pretrained(folder)
    return folder
