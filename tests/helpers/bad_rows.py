"""A JSON Lines file of conversations as people's files come: mostly good rows, and a dozen kinds of bad ones
spread through it (a malformed line, a line that is not UTF-8, a message without a role, an image part...).
Each bad line is written with the clause task=sft's refusal gives for it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.helpers.tiny_chat import conversations

BAD: list[tuple[bytes, str]] = [
    (b'{"messages": [{"role": "user", "content": "hi"}', "is not a JSON record"),
    (b"[1, 2, 3]", "is not a JSON object (it is a list)"),
    ('{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1"), "is not UTF-8 text"),
    (b'{"text": "a row of another file"}', "it has no 'messages'"),
    (b'{"messages": "hello there"}', "'messages' is text that is not JSON"),
    (b'{"messages": []}', "'messages' is not a non-empty list of messages"),
    (b'{"messages": [{"content": "hi"}, {"role": "assistant", "content": "hello"}]}',
     "message 1 of 'messages' has no 'role'"),
    (b'{"messages": [{"role": "user"}, {"role": "assistant", "content": "hello"}]}',
     "message 1 of 'messages' has no 'content'"),
    ((b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}, '
     b'{"role": "assistant", "content": "a cat"}]}'), "message 1 of 'messages' has a part of type 'image_url'"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]}',
     "tool call 1 of message 2 of 'messages' has no function name"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "it has no assistant turn to learn"),
    (b'{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "hello"}]}',
     "message 1 of 'messages' has a content that is neither text nor a list of text parts"),
]
"""(the line, the start of the reason the run gives for it)."""


def write_bad_file(path: Path, rows: int = 250, seed: int = 0) -> dict[int, str]:
    """``rows`` lines, each kind of bad line twice at random places after the first 12 lines (which a streamed run
    holds out for evaluation), one blank line too (no row); returns the bad lines' numbers and the reason
    expected for each."""
    rng = random.Random(seed)
    good = [json.dumps({"messages": c}).encode() for c in conversations(rows - 2 * len(BAD), seed=seed)]
    lines: list[tuple[bytes, str | None]] = [(g, None) for g in good]
    for line, reason in BAD * 2:
        lines.insert(rng.randrange(12, len(lines)), (line, reason))
    lines.insert(rng.randrange(12, len(lines)), (b"   ", None))
    path.write_bytes(b"".join(line + b"\n" for line, _ in lines))
    return {number: reason for number, (_, reason) in enumerate(lines, start=1) if reason is not None}
