"""One row of the user's data as what gets formatted: a conversation (``messages``; or a prompt and a
completion given as messages), a prompt and a completion as strings, or plain text. Bad rows are
refused in one sentence naming the file and line (:class:`BadRow`, turned into a ConfigError by the
caller, who knows the file)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.tasks.sft.config import DataFormat, SFTConfig

ROLES = ("system", "user", "assistant")


class BadRow(ValueError):
    """A row that cannot be trained on; its message is a clause, the caller prefixes file and line."""


@dataclass(frozen=True)
class Fields:
    """The columns a run reads (the config's names), picklable for ``datasets.map``'s worker processes."""

    messages: str
    prompt: str
    completion: str
    text: str

    @classmethod
    def of(cls, cfg: SFTConfig) -> Fields:
        return cls(cfg.messages_field, cfg.prompt_field, cfg.completion_field, cfg.text_field)

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
        raise BadRow(f"{origin} has none of the columns task=sft reads (it has {', '.join(columns)}): "
                     f"{self.messages!r} (conversations), {self.prompt!r} + {self.completion!r}, or {self.text!r}; "
                     "set task.messages_field, task.prompt_field/task.completion_field or task.text_field.")


@dataclass
class Conversation:
    """Messages to format with the chat template; those before ``prompt_turns`` are the prompt of a
    prompt/completion pair (0 for a conversation)."""

    messages: list[dict[str, str]]
    prompt_turns: int = 0


@dataclass
class Plain:
    """Text formatted without a template: ``prompt`` (may be empty) then ``completion``."""

    prompt: str
    completion: str


def read_row(row: dict[str, Any], data_format: DataFormat, fields: Fields) -> Conversation | Plain:
    if data_format is DataFormat.messages:
        return Conversation(messages(row[fields.messages], fields.messages))
    if data_format is DataFormat.text:
        return Plain("", _text(row[fields.text], fields.text))
    prompt, completion = row[fields.prompt], row[fields.completion]
    if isinstance(prompt, list) and isinstance(completion, list):
        turns = messages(prompt, fields.prompt)
        return Conversation(turns + messages(completion, fields.completion), len(turns))
    if isinstance(prompt, list) or isinstance(completion, list):
        raise BadRow(f"{fields.prompt!r} and {fields.completion!r} must be both strings or both lists of messages")
    return Plain(_text(prompt, fields.prompt, empty=True), _text(completion, fields.completion))


def messages(value: Any, field: str) -> list[dict[str, str]]:
    """A checked list of ``{role, content}`` messages (other keys are dropped)."""
    if not isinstance(value, list) or not value:
        raise BadRow(f"{field!r} is not a non-empty list of messages")
    checked = []
    for i, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            raise BadRow(f"message {i} of {field!r} is not an object with role and content")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise BadRow(f"message {i} of {field!r} has no {key!r}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise BadRow(f"message {i} of {field!r} has the role {role!r}, not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise BadRow(f"message {i} of {field!r} has a content that is not a string")
        checked.append({"role": role, "content": content})
    return checked


def _text(value: Any, field: str, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value.strip()):
        raise BadRow(f"{field!r} is not a non-empty string")
    return value
