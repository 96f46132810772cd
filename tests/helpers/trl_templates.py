"""The real chat templates TRL 1.16 ships (``trl/chat_templates/*.jinja``, read from the installed wheel, never
copied here), a tokenizer that knows each one's control tokens, and conversations to render with them.

A template's ``_training`` variant is TRL's patch of it with ``{% generation %}`` markers around what the model
writes (and, for Qwen3-style templates, the past reasoning kept): the reference for what is learnt. A template
that carries markers itself (LFM2.5) is its own reference; a few have none.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

VISION = ("_vl", "llava", "idefics", "smolvlm")
"""Templates of vision-language models (their text needs content parts, or is not their use): left out."""
CONTROL = re.compile(r"<\|[^|<>\s]{1,40}\|>|<｜[^｜<>]{1,40}｜>|<\|[A-Za-z_]{1,30}>|<[A-Za-z_]{1,30}\|>"
                     r"|</?[a-z][a-z_]{1,30}>|\[/?[A-Z][A-Z_]{1,20}\]")
"""What a control token looks like in a template's text (``<|im_end|>``, ``<｜Assistant｜>``, ``<|turn>``,
``<end_of_turn>``, ``</think>``, ``[INST]``...): each becomes a special token of the test tokenizer."""
BOS, EOS = "<|bos|>", "<|eos|>"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}]


def folder() -> Path:
    import trl

    return Path(trl.__file__).parent / "chat_templates"


def text_templates() -> list[str]:
    """The names of the text templates TRL ships (not the ``_training`` variants, not the vision ones)."""
    return sorted(p.stem for p in folder().glob("*.jinja")
                  if not p.stem.endswith("_training") and not any(v in p.stem for v in VISION))


def template(name: str) -> str:
    return (folder() / f"{name}.jinja").read_text(encoding="utf-8")


def training_variant(name: str) -> str | None:
    """TRL's marked variant of a template, the template itself if it has markers, else None."""
    path = folder() / f"{name}_training.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    own = template(name)
    return own if re.search(r"\{%-?\s*generation\s*-?%\}", own) else None


@cache
def _tokenizer_json(controls: tuple[str, ...]) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tokenizers import decoders as dec

    from tests.helpers.tiny_chat import corpus

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = dec.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=list(controls), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([*corpus(), "get_weather city Paris sunny 21 think tool_call"], trainer)
    return backend.to_str()


@cache
def controls() -> tuple[str, ...]:
    """Every control token of every shipped template and training variant (one tokenizer knows them all: a
    template's text never holds another's, so the others change nothing of its rows)."""
    texts = [template(name) for name in text_templates()] + [training_variant(name) or "" for name in text_templates()]
    return tuple(sorted({BOS, EOS, *(t for text in texts for t in CONTROL.findall(text))}))


def make_tokenizer(name: str):
    """A fast byte-level BPE tokenizer with the template (``name``) as its chat template, every control token of
    the shipped templates special, BOS and EOS of its own (one BPE training for all of them)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    special = controls()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(special)),
                                        bos_token=BOS, eos_token=EOS,
                                        extra_special_tokens=[t for t in special if t not in (BOS, EOS)],
                                        model_max_length=4096)
    tokenizer.chat_template = template(name)
    return tokenizer


def plain(system: bool) -> list[dict]:
    """Three exchanges of the toy grammar, with a system message or not."""
    from tests.helpers.tiny_chat import conversations

    chat = next(c for c in conversations(40, seed=21, max_turns=3) if len(c) >= 6 and c[0]["role"] != "system")
    return ([{"role": "system", "content": "you answer in one sentence ."}] if system else []) + chat[:6]


def reasoning() -> list[dict]:
    """Two exchanges whose answers carry their reasoning (which Qwen3-style templates drop from past turns)."""
    return [{"role": "user", "content": "what did the cat do ?"},
            {"role": "assistant", "content": "the cat chased the red ball .", "reasoning_content": "a cat chases ."},
            {"role": "user", "content": "and the dog ?"},
            {"role": "assistant", "content": "a dog found a tiny seed .", "reasoning_content": "a dog finds ."}]


def tool_use() -> list[dict]:
    """A tool call (content null), its result, the answer, then one more exchange."""
    return [{"role": "user", "content": "what is the weather in Paris ?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "name": "get_weather", "content": "sunny , 21"},
            {"role": "assistant", "content": "it is sunny in Paris ."},
            {"role": "user", "content": "what did the cat do ?"},
            {"role": "assistant", "content": "the cat chased the red ball ."}]
