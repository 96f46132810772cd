"""The chat template rendered as ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)``
renders it, at a fraction of its cost per call: the span finder renders each conversation prefix by prefix
(about ``2 x turns`` renders a conversation), and ``apply_chat_template`` spends most of each call
normalising its input (message objects to dicts, ``None`` keys dropped, every value rebuilt as plain JSON
data), which the messages of :func:`app.tasks.sft.conversations.messages` already are. The template is
compiled once (in transformers' own environment: the same sandbox, extensions and globals such as
``raise_exception``) and given what ``apply_chat_template`` gives it: the messages, ``tools``, ``documents``
(None), ``add_generation_prompt`` and the tokenizer's special tokens. tests/test_sft.py checks that both
render the same text for every template family.

A template with ``{% generation %}`` markers (``return_assistant_tokens_mask``'s) also renders with the
character ranges its markers enclose (:meth:`Template.marked`), as transformers' tracker records them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Ranges = list[tuple[int, int]]
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _plain(value: Any) -> Any:
    """A special token's value as plain data (strings, lists of strings), as apply_chat_template passes it."""
    if isinstance(value, str):
        return str.__str__(value)  # an AddedToken or another str subclass: its text
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


class Template:
    """``tokenizer``'s chat template (its ``chat_template`` when made), ready to render. Renders raise
    jinja2's TemplateError (or the TypeError, ValueError... of a template that cannot read a value) as
    the template does."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.source: str = tokenizer.get_chat_template()
        self.tokenizer = tokenizer
        self.has_markers = bool(GENERATION_MARKER.search(self.source))
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # a transformers without it: its public path, slower, and no markers
            self._compiled = None
            self.has_markers = False
        else:
            self._compiled = _own_copy(self.source, _compile_jinja_template)
        self._context = {key: _plain(value) for key, value in tokenizer.special_tokens_map.items()}

    def __call__(self, messages: list[dict[str, Any]], generation_prompt: bool = False,
                 tools: list[dict[str, Any]] | None = None) -> str:
        if self._compiled is None:
            text = self.tokenizer.apply_chat_template(messages, tools=list(tools or []) or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
            assert isinstance(text, str)
            return text
        return self._compiled.render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=generation_prompt, **self._context)

    def marked(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> tuple[str, Ranges]:
        """The rendered text and the ranges its ``{% generation %}`` blocks cover (in order)."""
        assert self._compiled is not None and self.has_markers
        blocks: list[str] = []
        ranges: Ranges = []
        with self._compiled.environment.activate_tracker(blocks, ranges):
            # The tracker reads ``blocks`` as it grows: a block's place is the length rendered before it.
            for block in self._compiled.generate(messages=messages, tools=tools, documents=None,
                                                 add_generation_prompt=False, **self._context):
                blocks.append(block)  # noqa: PERF402
        return "".join(blocks), [(int(a), int(b)) for a, b in ranges]


@functools.lru_cache(maxsize=8)
def _own_copy(template: str, compile_template: Callable[[str], Any]) -> Any:
    """The template compiled in transformers' environment, as our own object (transformers caches and
    shares its own), its globals a plain dict: jinja chains a template's globals over its environment's
    (a ChainMap), which every render copies key by key, half of a short render's time; a dict copies at
    C speed. The same names and values: the environment's globals are set once, when it is made."""
    compiled = compile_template(template).environment.from_string(template)
    compiled.globals = dict(compiled.globals)
    return compiled
