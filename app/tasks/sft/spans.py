"""Where the learnt tokens are: each learnt assistant turn as the chat template renders it when it is the
conversation's last turn, which is what the model sees at inference.

A conversation is rendered whole, and again up to each learnt assistant turn ``k``: the first ``k``
messages with the generation prompt (what the model is given) and the first ``k + 1`` (``through``). The
turn's learnt text is what ``through`` adds after the generation prompt (for a template without one, after
the turn's header: where its content begins), up to and including the end-of-turn token (``<|im_end|>``,
``<|eot_id|>``, ``</s>``...: found once on a probe conversation; the newline some templates put after it is
no output of the model). Where ``through`` is the start of the whole conversation, as it is for most
templates, the turn is learnt in the one row of the whole conversation. A template that rewrites a turn
once later turns follow (Qwen3 drops past reasoning, gpt-oss past analysis, others close a turn
differently mid-conversation) cannot have that turn learnt there: the turn gets its own row, ``through``
(packing puts such rows back together).

A template with ``{% generation %}`` markers says itself what the model writes: its ranges are learnt, and
the span finder's checked against them (the file's count of disagreements goes to the log).

The result is text and character ranges; ``tokens.py`` turns them into token ids and labels.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.tasks.sft.config import TrainOn
from app.tasks.sft.conversations import LEARNT_ROLE, BadRow, Conversation, Message, Plain
from app.tasks.sft.render import Ranges, Template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MARKER = "\u2063SFT\u2063"
"""A content no conversation has (around an invisible separator), rendered to locate a turn's content."""
PLAIN_ROLES = ("system", "user", LEARNT_ROLE)
PROBE: list[Message] = [{"role": "user", "content": "Hi"}, {"role": LEARNT_ROLE, "content": "Hello"}]


class UnusableTemplate(ValueError):
    """The template does not let the learnt spans be found; the message is one sentence's clause."""


@dataclass
class Formatted:
    """What is tokenized: ``text``, the character ranges learnt, and whether the tokenizer's own special
    tokens frame it (plain text: BOS first, EOS appended and learnt; templated text carries its own).
    ``own_row``: a turn in a row of its own, the template having rewritten it later in its conversation;
    ``disagreements``: its turns whose span the finder places otherwise than the template's markers."""

    text: str
    learnt: Ranges
    plain: bool
    own_row: bool = False
    disagreements: int = 0


@dataclass
class TemplateTraits:
    """What a probe conversation shows of a template: the token that ends an assistant turn, and whether
    it has a generation prompt (the text that opens the assistant's turn, given to the model)."""

    end_of_turn: str | None
    """The special token that ends the assistant's answer (where generation stops); None while probing."""
    generation_prompt: bool
    closing: str | None = None
    """For a template whose assistant turns end with no special token of their own (GLM-4): the one that follows
    an assistant turn when the conversation goes on (the next turn's opener, ``<|user|>``), which the model learns
    to stop with, appended to a conversation's last turn."""


@dataclass
class _Turn:
    learnt: Ranges
    disagreement: bool = False
    closed: bool = True
    """Whether the turn ends with a special token of its own."""


@dataclass
class SpanFinder:
    """Formats rows with the tokenizer's chat template and finds what ``train_on`` learns."""

    tokenizer: PreTrainedTokenizerBase
    train_on: TrainOn
    traits: TemplateTraits | None = None
    """The template's traits (:meth:`probe`); None: probed at the first conversation."""
    _template: Template | None = field(default=None, init=False)
    _special: re.Pattern[str] | None = field(default=None, init=False)
    _arguments_as_text: bool = field(default=False, init=False)
    """The template takes a tool call's arguments as JSON text (found when it fails on them as an object)."""
    _closing_token: re.Pattern[str] | None = field(default=None, init=False)
    """A special token at the end (of a ``search``'s ``endpos``)."""

    def __post_init__(self) -> None:
        specials = {t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special}
        specials |= {t for t in self.tokenizer.all_special_tokens if t}
        if specials:
            alternatives = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
            self._special, self._closing_token = re.compile(alternatives), re.compile(f"(?:{alternatives})$")

    def __call__(self, item: Conversation | Plain) -> list[Formatted]:
        if isinstance(item, Plain):
            start = 0 if self.train_on is TrainOn.all else len(item.prompt)
            text = item.prompt + item.completion
            return [Formatted(text, [(start, len(text))], plain=True)]
        return self.conversation(item)

    @property
    def template(self) -> Template:
        if self._template is None:  # compiled at the first conversation (plain text needs no template)
            self._template = Template(self.tokenizer)
        return self._template

    def render(self, messages: list[Message], generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        if self._arguments_as_text:
            messages = arguments_as_text(messages)
        try:
            return self.template(messages, generation_prompt, tools)
        except Exception as err:  # noqa: BLE001 - a template is code from the model's authors: any error it
            # raises (jinja's, or a TypeError on a value it cannot read) means it cannot render this row
            if not self._arguments_as_text and messages != arguments_as_text(messages):
                # A template that writes a tool call's arguments as text (DeepSeek-V3's), not as the object
                # apply_chat_template documents: their JSON text, from now on (one form for every render).
                self._arguments_as_text = True
                try:
                    return self.render(messages, generation_prompt, tools)
                except BadRow:
                    self._arguments_as_text = False
            raise BadRow(f"the chat template cannot render it ({type(err).__name__}: {str(err).strip()[:200]})") \
                from None

    # -- a conversation ------------------------------------------------------------------------------------

    def conversation(self, item: Conversation) -> list[Formatted]:
        messages, tools = item.messages, item.tools
        whole = self.render(messages, False, tools)
        check_rendered(item, whole)
        if self.train_on is TrainOn.all:
            return [Formatted(whole, [(0, len(whole))], plain=False)]
        own_rows, in_whole, disagreements = [], [], 0
        for k in self.learnt_turns(item):
            through = whole if k == len(messages) - 1 else self.render(messages[:k + 1], False, tools)
            turn = self.turn(messages, k, through, tools)
            if whole.startswith(through):
                whole, learnt = self._closed(whole, turn)
                in_whole.extend(learnt)
                disagreements += turn.disagreement
            else:
                text, learnt = self._closed(through, turn)
                own_rows.append(Formatted(text, learnt, False, own_row=True, disagreements=int(turn.disagreement)))
        if in_whole:
            own_rows.append(Formatted(whole, in_whole, False, disagreements=disagreements))
        return own_rows

    def _closed(self, text: str, turn: _Turn) -> tuple[str, Ranges]:
        """A turn that ends with a special token as it is; one that does not (GLM-4's) closed by the special token
        that follows it in ``text`` (the next turn's opener) or, at the end of the conversation, by the template's
        closing token (:attr:`TemplateTraits.closing`) appended."""
        if turn.closed:
            return text, turn.learnt
        *ranges, (begin, end) = turn.learnt
        follows = self._special.search(text, end) if self._special is not None else None
        if follows is not None and not text[end:follows.start()].strip():
            return text, [*ranges, (begin, follows.end())]
        closing = (self.traits or self.probe()).closing
        if text[end:].strip() or closing is None:
            raise UnusableTemplate("it ends an assistant turn with no special token, so the model could never "
                                   "learn where to stop")
        return text[:end] + closing, [*ranges, (begin, end + len(closing))]

    def learnt_turns(self, item: Conversation) -> list[int]:
        turns = [k for k, m in enumerate(item.messages) if m["role"] == LEARNT_ROLE and k >= item.prompt_turns]
        if not turns:
            where = "in the completion " if item.prompt_turns else ""
            raise BadRow(f"it has no assistant turn {where}to learn (task.train_on={self.train_on.value})")
        return turns[-1:] if self.train_on is TrainOn.last_assistant else turns

    def turn(self, messages: list[Message], k: int, through: str, tools: list[dict[str, Any]] | None) -> _Turn:
        """The learnt ranges of turn ``k``, the last of ``through`` (the first ``k + 1`` messages rendered): from
        where the model starts writing to the end of ``through`` (its trailing whitespace left out), which should be
        a special token, the end of turn the model learns to stop with (else :meth:`_closed` finds one)."""
        traits = self.traits or self.probe()
        begin = self._turn_start(messages, k, through, tools, traits)
        end = len(through.rstrip())
        if end <= begin:
            raise UnusableTemplate("it renders an assistant turn as nothing after the generation prompt, so there is "
                                   "nothing to learn")
        for call in messages[k].get("tool_calls", ()):
            if call["function"]["name"] not in through[begin:end]:
                raise BadRow(f"the chat template does not render the tool call of message {k + 1} "
                             f"({call['function']['name']}): give a template that renders tool calls")
        # A template that closes turns with the next turn's opener (GLM-4's) closes every turn so, whatever its
        # last token; another's turn is closed by the special token it ends with.
        closed = traits.closing is None and self._closing_token is not None and \
            bool(self._closing_token.search(through, begin, end))
        if not self.template.has_markers:
            return _Turn([(begin, end)], closed=closed)
        marked = self._marked(messages, k, through, tools)
        if not marked:  # the markers leave this turn out: the span finder's span
            return _Turn([(begin, end)], disagreement=True, closed=closed)
        return _Turn(marked, disagreement=(marked[0][0], marked[-1][1]) != (begin, end), closed=closed)

    def _turn_start(self, messages: list[Message], k: int, through: str, tools: list[dict[str, Any]] | None,
                    traits: TemplateTraits) -> int:
        """Where the model starts writing turn ``k`` in ``through``: after the generation prompt, or (a template
        without one) where the turn's content begins."""
        before = self._prompt(messages[:k], tools) if traits.generation_prompt else None
        if before is not None and through.startswith(before):
            return len(before)
        if before is not None:
            # Where the turn parts from the generation prompt (one that opens the reasoning, as DeepSeek-R1's
            # ``<think>\n``, which the turn's own rendering leaves out); the history before it must render alike.
            history = self.render(messages[:k], False, tools) if k else ""
            if not (before.startswith(history) and through.startswith(history)):
                raise UnusableTemplate("it renders the earlier turns differently once an assistant's turn follows "
                                       "them, so the turn the model writes cannot be told from them")
            return len(os.path.commonprefix([before, through]))
        return self._content_start(messages, k, through, tools, str(messages[k].get("content", "")).strip())

    def _prompt(self, history: list[Message], tools: list[dict[str, Any]] | None) -> str | None:
        """The history and the generation prompt; None for a turn that opens the conversation and a template
        that cannot render an empty history."""
        if history:
            return self.render(history, True, tools)
        try:
            return self.render([], True, tools)
        except BadRow:
            return None

    def _content_start(self, messages: list[Message], k: int, through: str, tools: list[dict[str, Any]] | None,
                       content: str) -> int:
        """A template without a generation prompt: the turn's header (``[/INST]``'s space...) is not learnt,
        so the turn begins where its content does. The content is where it stands once in the turn; else (a
        content the frame also holds, or one the template changes) where the same turn rendered with a marker
        as its content puts it; failing both, at the turn's start."""
        start = len(self.render(messages[:k], False, tools)) if k else 0
        turn = through[start:]
        if content and turn.count(content) == 1:
            return start + turn.find(content)
        marked = self.render([*messages[:k], {**messages[k], "content": MARKER}], False, tools)
        at = marked.find(MARKER, start)
        if at >= 0 and marked.startswith(through[:start]) and turn.startswith(marked[start:at]):
            return at
        return start

    def _marked(self, messages: list[Message], k: int, through: str, tools: list[dict[str, Any]] | None) -> Ranges:
        """The ranges the template's ``{% generation %}`` markers put on turn ``k`` in ``through`` (each without
        the whitespace after it: the newline after the end-of-turn token is no output of the model)."""
        try:
            text, blocks = self.template.marked(messages[:k + 1], tools)
        except Exception:  # noqa: BLE001 - rendered unmarked already: the markers are what fails
            return []
        start = len(self.render(messages[:k], False, tools)) if k else 0
        if text != through:
            return []
        return [(a, a + len(text[a:b].rstrip())) for a, b in blocks if a >= start and text[a:b].strip()]

    # -- the template's traits -----------------------------------------------------------------------------

    def probe(self) -> TemplateTraits:
        """The template's end-of-turn token and generation prompt, from a two-turn conversation (and, where its
        turns end with no special token, its closing token from a third turn); also refuses a template that cannot
        be trained on before any data is read."""
        if self.traits is None:
            opened = self.render(PROBE[:1], True) != self.render(PROBE[:1], False)
            text = self.render(PROBE)
            end = len(text.rstrip())
            closing = None
            if self._closing_token is None or not self._closing_token.search(text, 0, end):
                follows = self._special.search(self.render([*PROBE, PROBE[0]]), end) if self._special else None
                closing = follows.group() if follows is not None else None
            finder = SpanFinder(self.tokenizer, TrainOn.assistant, TemplateTraits(None, opened, closing))
            (formatted,) = finder.conversation(Conversation([dict(m) for m in PROBE]))
            begin = formatted.learnt[-1][0]
            assert self._special is not None  # the turn ends with a special token
            answer = formatted.text.find(str(PROBE[-1]["content"]), begin)
            first = self._special.search(formatted.text, max(answer, begin))
            assert first is not None
            self.traits = TemplateTraits(first.group(), opened, closing)
        return self.traits


def arguments_as_text(messages: list[Message]) -> list[Message]:
    """The messages with each tool call's arguments as their JSON text (as OpenAI's API gives them)."""
    def text(call: dict[str, Any]) -> dict[str, Any]:
        arguments = call["function"]["arguments"]
        if isinstance(arguments, str):
            return call
        return {**call, "function": {**call["function"], "arguments": json.dumps(arguments, ensure_ascii=False)}}

    return [{**m, "tool_calls": [text(c) for c in m["tool_calls"]]} if "tool_calls" in m else m for m in messages]


def check_rendered(item: Conversation, text: str) -> None:
    """A template that leaves out what a row holds (a tool call, the tools, a tool's result) would train on
    something else than the row: one clause naming what it drops."""
    for i, message in enumerate(item.messages, start=1):
        for call in message.get("tool_calls", ()):
            if call["function"]["name"] not in text:
                raise BadRow(f"the chat template does not render the tool call of message {i} "
                             f"({call['function']['name']}): give a template that renders tool calls")
        content = str(message.get("content", "")).strip()
        if message["role"] not in PLAIN_ROLES and content and content not in text:
            raise BadRow(f"the chat template leaves out message {i} (role {message['role']!r})")
    for tool in item.tools or ():
        name = tool.get("function", {}).get("name")
        if isinstance(name, str) and name not in text:
            raise BadRow(f"the chat template does not render its tools ({name}): give a template that renders "
                         "apply_chat_template's tools")
