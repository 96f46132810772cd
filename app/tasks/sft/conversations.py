"""One row of the user's data as what gets formatted: a conversation (``messages``; or a prompt and a
completion given as messages), a prompt and a completion as strings, or plain text. Bad rows are
refused in one clause naming what is wrong (:class:`BadRow`; the caller knows the file and the line).

Messages are read as people's data has them, and handed to the chat template as
``tokenizer.apply_chat_template`` hands them (keys whose value is None dropped, the reasoning under each
name templates read): any role the template renders (``tool``, ``ipython``, ``developer``...);
ShareGPT's ``from``/``value``; ``content`` as a string or a list of text parts (an image part is refused:
training is on text); an assistant's ``tool_calls`` (OpenAI's ``{type, function: {name, arguments}}`` or
a flat ``{name, arguments}``, the arguments an object or its JSON text; the content then may be null);
a tool result's ``name`` and ``tool_call_id``; the reasoning (``reasoning_content``, ``thinking`` or
``reasoning``). A row's ``tools`` column (function schemas, or their JSON text) goes to the template as
``apply_chat_template(tools=...)`` gives it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app.tasks.sft.config import DataFormat, SFTConfig

LEARNT_ROLE = "assistant"
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool",
                  "function_response": "tool"}
"""ShareGPT's speaker names (``from``) -> roles; any other name is its own role (``system``, ``tool``)."""
REASONING = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning comes under; templates read the first two (transformers' aliasing)."""
TEXT_PARTS = ("text", "input_text", "output_text")
Message = dict[str, Any]


class BadRow(ValueError):
    """A row that cannot be trained on; its message is a clause, the caller prefixes file and line."""


@dataclass(frozen=True)
class Fields:
    """The columns a run reads (the config's names), picklable for ``datasets.map``'s worker processes."""

    messages: str
    prompt: str
    completion: str
    text: str
    tools: str = "tools"

    @classmethod
    def of(cls, cfg: SFTConfig) -> Fields:
        return cls(cfg.messages_field, cfg.prompt_field, cfg.completion_field, cfg.text_field, cfg.tools_field)

    def with_messages(self, columns: list[str]) -> Fields:
        """ShareGPT's ``conversations`` column read as the messages where the default ``messages`` is absent."""
        if self.messages == "messages" and "messages" not in columns and "conversations" in columns:
            return Fields("conversations", self.prompt, self.completion, self.text, self.tools)
        return self

    def detect(self, columns: list[str], chosen: DataFormat, origin: str) -> DataFormat:
        """The format of a split with these columns (``task.format=auto``), or a check of the chosen one."""
        needs = {DataFormat.messages: [self.messages], DataFormat.prompt_completion: [self.prompt, self.completion],
                 DataFormat.text: [self.text]}
        if chosen is not DataFormat.auto:
            missing = [c for c in needs[chosen] if c not in columns]
            if missing:
                raise BadRow(f"{origin} has no {' or '.join(repr(c) for c in missing)} column for task.format="
                             f"{chosen.value} (it has {', '.join(columns)}); set the task.*_field names.")
            return chosen
        for data_format, wanted in needs.items():
            if all(c in columns for c in wanted):
                return data_format
        raise BadRow(f"{origin} has none of the columns task=sft reads (it has {', '.join(columns) or 'none'}): "
                     f"{self.messages!r} (conversations), {self.prompt!r} + {self.completion!r}, or {self.text!r}; "
                     "set task.messages_field, task.prompt_field/task.completion_field or task.text_field.")


@dataclass
class Conversation:
    """Messages to format with the chat template; those before ``prompt_turns`` are the prompt of a
    prompt/completion pair (0 for a conversation); ``tools``: the function schemas the template is given."""

    messages: list[Message]
    prompt_turns: int = 0
    tools: list[dict[str, Any]] | None = field(default=None)


@dataclass
class Plain:
    """Text formatted without a template: ``prompt`` (may be empty) then ``completion``."""

    prompt: str
    completion: str


def read_row(row: dict[str, Any], data_format: DataFormat, fields: Fields) -> Conversation | Plain:
    if data_format is DataFormat.messages:
        return Conversation(messages(_column(row, fields.messages), fields.messages), 0, tools(row, fields.tools))
    if data_format is DataFormat.text:
        return Plain("", _text(_column(row, fields.text), fields.text))
    prompt, completion = _column(row, fields.prompt), _column(row, fields.completion)
    if isinstance(prompt, str) and isinstance(completion, str):
        return Plain(_text(prompt, fields.prompt, empty=True), _text(completion, fields.completion))
    turns = as_messages(prompt, fields.prompt, "user")
    return Conversation(turns + as_messages(completion, fields.completion, LEARNT_ROLE), len(turns),
                        tools(row, fields.tools))


def as_messages(value: Any, name: str, role: str) -> list[Message]:
    """A list of messages, or a string as one message of ``role`` (a string prompt beside a conversational
    completion is the user's turn; a string answer after a conversational prompt is the assistant's)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}] if value.strip() or role == LEARNT_ROLE else []
    return messages(value, name)


def _column(row: dict[str, Any], name: str) -> Any:
    if row.get(name) is None:
        raise BadRow(f"it has no {name!r}")
    return row[name]


def messages(value: Any, name: str) -> list[Message]:
    """The row's messages, checked and as the chat template reads them."""
    if isinstance(value, str):
        value = _json(value, f"{name!r}")
    if not isinstance(value, list) or not value:
        raise BadRow(f"{name!r} is not a non-empty list of messages")
    return [message(m, i, name) for i, m in enumerate(value, start=1)]


def message(value: Any, index: int, name: str) -> Message:
    """One message: the keys a template reads (``role``, ``content``, ``tool_calls``, the reasoning, a tool
    result's ``name`` and ``tool_call_id``...), None-valued keys dropped."""
    where = f"message {index} of {name!r}"
    if not isinstance(value, dict):
        raise BadRow(f"{where} is not an object with a role and a content")
    m = {k: v for k, v in value.items() if v is not None}
    if "role" not in m and "from" in m:  # ShareGPT
        speaker = m.pop("from")
        m["role"] = SHAREGPT_ROLES.get(speaker, speaker)
        if "value" in m:
            m["content"] = m.pop("value")
    role = m.get("role")
    if not isinstance(role, str) or not role.strip():
        raise BadRow(f"{where} has no 'role'")
    out: Message = {k: v for k, v in m.items() if k not in ("content", "tool_calls", *REASONING)}
    calls = m.get("tool_calls")
    if calls is not None:
        if isinstance(calls, str):
            calls = _json(calls, f"the tool_calls of {where}")
        if not isinstance(calls, list):
            raise BadRow(f"the tool_calls of {where} are not a list")
        if calls:
            out["tool_calls"] = [tool_call(c, f"tool call {k} of {where}") for k, c in enumerate(calls, start=1)]
    reasoning = next((m[k] for k in REASONING if isinstance(m.get(k), str)), None)
    if reasoning is not None:
        out["thinking"] = out["reasoning_content"] = reasoning
    if "content" in m:
        out["content"] = content_text(m["content"], where)
    elif "tool_calls" in out or reasoning is not None:
        out["content"] = ""  # many templates read a tool call's content, and fail on a missing one
    else:
        raise BadRow(f"{where} has no 'content'")
    return out


def content_text(content: Any, where: str) -> str:
    """A content as text: a string, or a list of text parts joined (as templates that read parts join them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRow(f"{where} has a content that is neither text nor a list of text parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, dict) and (kind in TEXT_PARTS or (kind is None and isinstance(part.get("text"), str))):
            texts.append(str(part.get("text", "")))
            continue
        raise BadRow(f"{where} has {'a part of type ' + repr(kind) if kind else 'a part that is not text'}: training "
                     "is on text only (leave such rows out, or their non-text parts)")
    return "".join(texts)


def tool_call(value: Any, where: str) -> dict[str, Any]:
    """A tool call as templates read it: ``{type: function, function: {name, arguments: {...}}}``."""
    if not isinstance(value, dict):
        raise BadRow(f"{where} is not an object")
    function = value.get("function", value)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise BadRow(f"{where} has no function name")
    arguments = function.get("arguments", function.get("parameters"))
    if isinstance(arguments, str):
        arguments = _json(arguments, f"the arguments of {where}") if arguments.strip() else {}
    call: dict[str, Any] = {"type": "function",
                            "function": {"name": function["name"], "arguments": _no_none(arguments or {})}}
    if value.get("id") is not None:
        call["id"] = value["id"]
    return call


def tools(row: dict[str, Any], name: str) -> list[dict[str, Any]] | None:
    """The row's function schemas (a list, or its JSON text), each as ``{type: function, function: {...}}``."""
    value = row.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        value = _json(value, f"{name!r}")
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow(f"{name!r} is not a list of function schemas")
    schemas = [_no_none(t) for t in value]
    return [t if "function" in t else {"type": "function", "function": t} for t in schemas] or None


def _no_none(value: Any) -> Any:
    """Without the None a typed dataset fills in for keys a row lacks (a tool schema's, an argument's)."""
    if isinstance(value, dict):
        return {k: _no_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_none(v) for v in value]
    return value


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise BadRow(f"{what} is text that is not JSON") from None


def _text(value: Any, name: str, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value.strip()):
        raise BadRow(f"{name!r} is not a non-empty string")
    return value
