"""``task=grpo``'s data: one prompt per row (``task.prompt_field``), read as ``task=sft`` reads rows
(``sft/records.py``: record by record, a bad line one bad row; ``sft/conversations.py``: messages as people's
data has them, a ``tools`` column), and tokenized once:

- a list of messages: rendered by the chat template with the generation prompt (``SpanFinder.render``,
  which refuses a row the template cannot render in one clause), its special tokens its own;
- a string: as it is, after the tokenizer's BOS.

Every other column is kept (as JSON text) for the reward functions, which get it by name. A row that
cannot be read is returned with its ``error`` (the sentence naming its place), as ``tokens.encode_rows``
returns one, for ``sft/bad_rows.py`` to judge (``task.bad_rows``); so is a prompt that leaves no room for
``task.max_completion_length`` within ``task.block_size`` (``task.overlong=refuse``), which ``drop`` leaves out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.tasks.sft.config import Overlong, TrainOn
from app.tasks.sft.conversations import BadRow, messages, tools
from app.tasks.sft.records import Places, batch_rows, raw_text, row_record
from app.tasks.sft.spans import SpanFinder

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

COLUMNS = ("prompt_ids", "prompt", "columns", "conversational", "dropped", "place", "error", "raw")


@dataclass(frozen=True)
class PromptFields:
    """How a split's prompts are read and fitted (picklable for ``datasets.map``)."""

    prompt: str
    tools: str
    block_size: int
    max_completion_length: int
    overlong: Overlong
    places: Places

    @property
    def room(self) -> int:
        """The most tokens a prompt may have: the block less the completion's room."""
        return self.block_size - self.max_completion_length


def read_prompt(record: dict[str, Any], fields: PromptFields) -> tuple[Any, list[dict[str, Any]] | None]:
    """The row's prompt as it is given (a string, or its messages checked) and its tools; BadRow if unusable."""
    value = record.get(fields.prompt)
    if value is None:
        raise BadRow(f"it has no {fields.prompt!r}")
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):
        return messages(value, fields.prompt), tools(record, fields.tools)
    raise BadRow(f"{fields.prompt!r} is neither a string nor a list of messages")


def encode_prompts(batch: dict[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase,
                   fields: PromptFields) -> dict[str, list]:
    """A ``datasets.map`` batch -> ``prompt_ids``, ``prompt`` (as given, JSON text), ``columns`` (the others, JSON
    text), ``conversational`` (1: formatted by the chat template), ``dropped`` (1: too long, task.overlong=drop),
    ``place``, ``error`` (why a bad row is refused, naming its place; empty for a good one) and ``raw`` (the row
    as it came, for a bad one). Errors are returned, not raised (a pool of tokenizing processes would be torn
    down mid-work)."""
    finder = SpanFinder(tokenizer, TrainOn.assistant)
    rows = batch_rows(batch)
    out: dict[str, list] = {column: [] for column in COLUMNS}
    texts: list[tuple[str, bool]] = []
    for index, row in zip(indices, rows, strict=True):
        place = fields.places.place(row, index)
        prompt: Any = None
        others: dict[str, Any] = {}
        text, plain, error = "", True, ""
        try:
            record = row_record(row)
            prompt, row_tools = read_prompt(record, fields)
            others = {k: v for k, v in record.items() if k != fields.prompt}
            if isinstance(prompt, list):
                text, plain = finder.render(prompt, True, row_tools), False
            else:
                text = prompt
        except BadRow as err:
            error = f"{fields.places.where(place)}: {err}."
        texts.append((text, plain))
        out["prompt"].append(json.dumps(prompt, ensure_ascii=False))
        out["columns"].append(json.dumps(others, ensure_ascii=False, default=str))
        out["conversational"].append(int(not plain))
        out["place"].append(place)
        out["error"].append(error)
        out["raw"].append(raw_text(row) if error else "")
    ids_of: list[list[int]] = [[] for _ in rows]
    for plain in (True, False):  # a string gets the tokenizer's BOS; a template's text carries its own tokens
        group = [i for i, (_, p) in enumerate(texts) if p == plain and not out["error"][i]]
        if group:
            encoded = tokenizer([texts[i][0] for i in group], add_special_tokens=plain, return_attention_mask=False,
                                verbose=False)["input_ids"]
            for i, ids in zip(group, encoded, strict=True):
                ids_of[i] = list(ids)
    out["prompt_ids"], out["dropped"] = ids_of, [0] * len(rows)
    for i, ids in enumerate(out["prompt_ids"]):
        if not out["error"][i] and not ids:
            out["error"][i] = f"{fields.places.where(out['place'][i])}: its prompt is empty (no token to start from)."
            out["raw"][i] = raw_text(rows[i])
        if out["error"][i] or len(ids) <= fields.room:
            continue
        if fields.overlong is Overlong.drop:
            out["dropped"][i], out["prompt_ids"][i] = 1, []
            continue
        where = fields.places.where(out["place"][i])
        out["error"][i] = (f"{where}: its prompt is {len(ids)} tokens, which leaves no room for task.max_completion_"
                           f"length={fields.max_completion_length} within task.block_size={fields.block_size} "
                           "(give a larger block_size, or task.overlong=drop).")
        out["raw"][i], out["prompt_ids"][i] = raw_text(rows[i]), []
    return out


def prompt_features() -> datasets.Features:
    """The columns of :func:`encode_prompts` (a batch of bad rows has empty lists: no type to infer)."""
    from datasets import Features, List, Value

    return Features({"prompt_ids": List(Value("int32")), "prompt": Value("string"), "columns": Value("string"),
                     "conversational": Value("int64"), "dropped": Value("int64"), "place": Value("int64"),
                     "error": Value("string"), "raw": Value("string")})
