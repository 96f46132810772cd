"""The chat template rendered as ``tokenizer.apply_chat_template(messages, tokenize=False)`` renders it, at
a fraction of its cost per call: the span finder renders each conversation prefix by prefix (about
``2 x turns`` renders a conversation), and ``apply_chat_template`` spends most of each call normalising
its input (message objects to dicts, ``None`` keys dropped, every value rebuilt as plain JSON data), which
the messages of :func:`app.tasks.sft.conversations.messages` already are: fresh ``{role, content}`` dicts
of strings. The template is compiled once (in transformers' own environment: the same sandbox, extensions
and globals such as ``raise_exception``) and given what ``apply_chat_template`` gives it: the messages,
``tools`` and ``documents`` (None), ``add_generation_prompt`` and the tokenizer's special tokens.
tests/test_sft.py checks that both render the same text for every template family."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Render = Callable[[list[dict[str, str]], bool], str]
"""(messages, add_generation_prompt) -> the rendered text; raises jinja2's TemplateError as the template does."""


def _plain(value: Any) -> Any:
    """A special token's value as plain data (strings, lists of strings), as apply_chat_template passes it."""
    if isinstance(value, str):
        return str.__str__(value)  # an AddedToken or another str subclass: its text
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def renderer(tokenizer: PreTrainedTokenizerBase) -> Render:
    """A render function for ``tokenizer``'s chat template (its ``chat_template`` at this call)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: its public path, slower
        return lambda messages, generation_prompt: _apply(tokenizer, messages, generation_prompt)
    compiled = _own_copy(tokenizer.get_chat_template(), _compile_jinja_template)
    context = {key: _plain(value) for key, value in tokenizer.special_tokens_map.items()}

    def render(messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=generation_prompt, **context)

    return render


@functools.lru_cache(maxsize=8)
def _own_copy(template: str, compile_template: Callable[[str], Any]) -> Any:
    """The template compiled in transformers' environment, as our own object (transformers caches and
    shares its own), its globals a plain dict: jinja chains a template's globals over its environment's
    (a ChainMap), which every render copies key by key, half of a short render's time; a dict copies at
    C speed. The same names and values: the environment's globals are set once, when it is made."""
    compiled = compile_template(template).environment.from_string(template)
    compiled.globals = dict(compiled.globals)
    return compiled


def _apply(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert isinstance(text, str)
    return text
