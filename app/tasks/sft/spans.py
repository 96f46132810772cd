"""Where the learnt tokens are, found from the chat template alone (no ``{% generation %}`` markers).

A conversation is rendered whole, and again prefix by prefix: for each learnt assistant turn ``k``,
the first ``k`` messages with the generation prompt (what the model is given) and the first ``k + 1``
without it. If the template renders a conversation as the concatenation of its turns, both are
prefixes of the whole, and the text between them is turn ``k`` as the model must write it: its content
and the end-of-turn token after it (the first special token after the content; a template's header
before the content, such as ``<|im_start|>assistant\\n``, is not learnt). A template for which the
prefixes differ (one that rewrites earlier turns) or that ends an assistant turn without a special
token (the model could never learn to stop) is refused, instead of training on an empty or wrong mask.

The result is text and character ranges; ``tokens.py`` turns them into token ids and labels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.tasks.sft.config import TrainOn
from app.tasks.sft.conversations import BadRow, Conversation, Plain
from app.tasks.sft.render import Render, renderer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Ranges = list[tuple[int, int]]
MARKER = "\u2063SFT\u2063"
"""A content no conversation has (around an invisible separator), rendered to locate a turn's content."""


class UnusableTemplate(ValueError):
    """The template does not let the learnt spans be found; the message is one sentence's clause."""


@dataclass
class Formatted:
    """What is tokenized: ``text``, the character ranges learnt, and whether the tokenizer's own special
    tokens frame it (plain text: BOS first, EOS appended and learnt; templated text carries its own)."""

    text: str
    learnt: Ranges
    plain: bool


class SpanFinder:
    """Formats rows with the tokenizer's chat template and finds what ``train_on`` learns."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, train_on: TrainOn):
        self.tokenizer, self.train_on = tokenizer, train_on
        self._render: Render | None = None  # compiled at the first conversation (plain text needs no template)
        specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        specials |= {t for t in tokenizer.all_special_tokens if t}
        self._special = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
            if specials else None

    def __call__(self, item: Conversation | Plain) -> Formatted:
        if isinstance(item, Plain):
            start = 0 if self.train_on is TrainOn.all else len(item.prompt)
            text = item.prompt + item.completion
            return Formatted(text, [(start, len(text))], plain=True)
        return self.conversation(item)

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        if self._render is None:
            self._render = renderer(self.tokenizer)
        try:
            return self._render(messages, generation_prompt)
        except TemplateError as err:
            raise BadRow(f"the chat template refuses it ({str(err).strip()})") from None

    def learnt_turns(self, item: Conversation) -> list[int]:
        turns = [k for k, m in enumerate(item.messages) if m["role"] == "assistant" and k >= item.prompt_turns]
        if not turns:
            where = "in the completion" if item.prompt_turns else ""
            raise BadRow(f"it has no assistant turn {where}to learn (task.train_on={self.train_on.value})"
                         .replace("  ", " "))
        return turns[-1:] if self.train_on is TrainOn.last_assistant else turns

    def conversation(self, item: Conversation) -> Formatted:
        messages = item.messages
        whole = self.render(messages, False)
        if self.train_on is TrainOn.all:
            return Formatted(whole, [(0, len(whole))], plain=False)
        learnt = []
        for k in self.learnt_turns(item):
            before = self.render(messages[:k], True) if k else ""
            through = self.render(messages[:k + 1], False)
            if not (whole.startswith(through) and through.startswith(before)):
                raise UnusableTemplate("it does not render a conversation as the concatenation of its turns (the "
                                       f"first {k + 1} messages do not render as the start of the whole), so the "
                                       "assistant's tokens cannot be found")
            learnt.append(self.turn_span(messages[:k], before, through, messages[k]["content"]))
        return Formatted(whole, learnt, plain=False)

    def turn_span(self, history: list[dict[str, str]], before: str, through: str, content: str) -> tuple[int, int]:
        """The learnt range of the assistant turn ``through[len(before):]``: its content and the first
        special token after it. The content is where it stands once in the turn; else (a content the
        turn's frame also holds, or one the template changes) where the same turn rendered with a
        marker as its content puts it: what comes before the marker (the turn's header) and after it
        (the end-of-turn token, a newline...) frame every content alike. Failing both: the whole turn
        up to the special token."""
        turn, content = through[len(before):], content.strip()
        if content and turn.count(content) == 1:
            begin = len(before) + turn.find(content)
            content_end = begin + len(content)
        else:
            marked = self.render([*history, {"role": "assistant", "content": MARKER}], False)
            at = marked.find(MARKER, len(before))
            header, trailer = (marked[len(before):at], marked[at + len(MARKER):]) if at >= 0 else ("", "")
            if at >= 0 and marked.startswith(before) and turn.startswith(header) and turn.endswith(trailer) \
                    and len(header) + len(trailer) <= len(turn):
                begin, content_end = len(before) + len(header), len(through) - len(trailer)
            else:
                begin, content_end = len(before), len(before)
        end_of_turn = self._special.search(through, content_end) if self._special is not None else None
        if end_of_turn is None:
            raise UnusableTemplate("it ends an assistant turn with no special token, so the model could never "
                                   "learn where to stop")
        return begin, end_of_turn.end()

    def end_of_turn(self) -> str:
        """The token that ends an assistant turn (``<|im_end|>``, ``<|eot_id|>``, ``</s>``...): found on a
        probe conversation, which also refuses an unusable template before any data is read."""
        probe = Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
        finder = SpanFinder(self.tokenizer, TrainOn.assistant)
        formatted = finder.conversation(probe)
        (begin, end), = formatted.learnt
        assert self._special is not None  # turn_span found a special token, so there are some
        return self._special.findall(formatted.text, begin, end)[-1]  # the learnt turn ends with it
