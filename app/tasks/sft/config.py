"""Schema of ``task=sft``: ``task=causal_lm``'s model, data sources and block size, plus what makes
instruction tuning (the data's format, the chat template, which tokens are learnt). Kept free of torch,
transformers and datasets: config composition imports it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from app.config import ConfigError
from app.tasks.causal_lm.config import CausalLMConfig


class DataFormat(str, enum.Enum):
    auto = "auto"
    """From the columns: ``task.messages_field``, else ``task.prompt_field`` + ``task.completion_field``,
    else ``task.text_field``."""
    messages = "messages"
    """Conversations: a list of ``{role, content}`` (system / user / assistant), any number of turns."""
    prompt_completion = "prompt_completion"
    """A prompt and its completion: two strings, or two lists of messages."""
    text = "text"
    """Plain text, learnt whole (no template)."""


class TrainOn(str, enum.Enum):
    assistant = "assistant"
    """Every assistant turn (of the completion, for prompt/completion data), its end-of-turn token included."""
    last_assistant = "last_assistant"
    """The last assistant turn only (earlier ones are context)."""
    completion = "completion"
    """Prompt/completion data: the completion, its end-of-turn (or EOS) token included."""
    all = "all"
    """Every token of the formatted text, the template's headers included."""


class BadRows(str, enum.Enum):
    refuse = "refuse"
    """Stop before training when any row is bad: one sentence counting them all and naming the first few."""
    skip = "skip"
    """Train on the rest: each bad row written to ``<run>/skipped_rows.jsonl`` with its place and reason, and
    counted in the log (still refused when more than ``task.max_bad_fraction`` of a file's rows are bad)."""


class Overlong(str, enum.Enum):
    truncate = "truncate"
    """Keep the first ``task.block_size`` tokens (a conversation left with nothing learnt is dropped)."""
    drop = "drop"
    """Leave the conversation out (counted in the log)."""
    refuse = "refuse"
    """Stop before training, naming the file and line."""


class TruncationMode(str, enum.Enum):
    """Which tokens of a prompt longer than ``task.max_prompt_length`` stay (``truncation.cut_prompt``)."""

    keep_end = "keep_end"
    """Its last tokens: the question nearest the answer (a long system prompt or early turns go first)."""
    keep_start = "keep_start"
    """Its first tokens."""


@dataclass
class SFTConfig(CausalLMConfig):
    """Instruction tuning of an ``AutoModelForCausalLM`` on conversations or prompt/completion pairs."""

    DATA_NEEDED: ClassVar[str] = "conversations"
    DATA_FILES: ClassVar[str] = "JSON Lines, JSON, parquet... of messages, prompt/completion pairs or text"

    name: str = "sft"
    format: DataFormat = DataFormat.auto
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    tools_field: str = "tools"
    """A column of function schemas (a list, or its JSON text), given to the chat template with each row's
    messages as ``apply_chat_template(tools=...)`` gives them; absent or null: none."""
    chat_template: str | None = None
    """null: the tokenizer's own; ``chatml`` (built in, adds ``<|im_start|>``/``<|im_end|>`` to a tokenizer
    that lacks them); or a Jinja file. Saved with the exported tokenizer."""
    train_on: TrainOn = TrainOn.assistant
    overlong: Overlong = Overlong.truncate
    """A conversation longer than ``task.block_size`` tokens."""
    max_prompt_length: int | None = None
    """Prompt/completion data: cut every prompt (the tokens before the completion) to this many tokens (before
    ``task.overlong`` looks at the row), so a long prompt leaves the completion room; null: prompts are not cut."""
    truncation_mode: TruncationMode = TruncationMode.keep_end
    """Which of a cut prompt's tokens stay: ``keep_end`` its last (the question nearest the answer),
    ``keep_start`` its first; a leading BOS stays either way."""
    bad_rows: BadRows = BadRows.refuse
    """A row that cannot be trained on (malformed JSON, a message without a role, a template that cannot render
    it...): ``refuse`` reads every file first and stops, counting every bad row and naming the first few;
    ``skip`` leaves them out (``<run>/skipped_rows.jsonl``)."""
    max_bad_fraction: float = 0.1
    """With ``task.bad_rows=skip``: the share of a file's rows that may be bad before the run is refused anyway."""
    num_proc: int = 1
    """Processes that tokenize the map-style splits (``datasets.map(num_proc=...)``)."""
    loss_chunk: int = 256
    """Positions whose vocabulary-sized logits exist at once in the loss (chunked cross-entropy, recomputed
    in backward; ``app/tasks/sft/chunked.py``); 0: the whole block's logits at once (the plain loss)."""
    sample_prompts: int = 0
    """At each evaluation, the first this many evaluation prompts (each conversation up to its first learnt
    token) completed greedily on the main process, written to ``<run>/samples/step_<N>.jsonl`` and the
    trackers; 0: none."""
    max_new_tokens: int = 64
    """The most tokens each sample generates (it stops earlier at EOS or the end-of-turn token)."""

    def check_data_format(self, found: DataFormat, origin: str) -> None:
        """The rules between ``task.train_on`` and the data's format, once read (``task.format=auto`` finds
        it from the columns): a completion needs prompt/completion pairs; plain text is learnt whole."""
        holds = {DataFormat.messages: "conversations (messages)", DataFormat.prompt_completion: "prompt/completion "
                 "pairs", DataFormat.text: "plain text"}.get(found, found.value)
        if self.train_on is TrainOn.completion and found is not DataFormat.prompt_completion:
            raise ConfigError(f"task.train_on=completion needs prompt/completion pairs, and {origin} holds {holds}; "
                              "use task.train_on=assistant (every assistant turn) or last_assistant.")
        if self.train_on is TrainOn.last_assistant and found is DataFormat.text:
            raise ConfigError(f"task.train_on=last_assistant needs conversations, and {origin} holds plain text, "
                              "learnt whole; leave task.train_on at its default.")

    def keys_scaling(self, metric: str) -> tuple[str, ...]:
        # Which tokens are learnt (and so averaged over) changes every per-token metric.
        return ("task.train_on",) if metric in ("eval/loss", "eval/perplexity", "eval/token_accuracy") else ()

    def check(self) -> None:
        super().check()
        if self.max_prompt_length is not None and not 1 <= self.max_prompt_length < self.block_size:
            raise ConfigError(f"task.max_prompt_length must be at least 1 and less than task.block_size="
                              f"{self.block_size} (room for the answer), got {self.max_prompt_length}.")
        if self.max_prompt_length is not None and self.format in (DataFormat.messages, DataFormat.text):
            raise ConfigError(f"task.max_prompt_length cuts the prompt of prompt/completion data, and task.format="
                              f"{self.format.value}; leave it null.")
        if not 0.0 <= self.max_bad_fraction < 1.0:
            raise ConfigError(f"task.max_bad_fraction must be in [0, 1), got {self.max_bad_fraction}.")
        if self.num_proc < 1:
            raise ConfigError(f"task.num_proc must be at least 1, got {self.num_proc}.")
        if self.sample_prompts < 0 or self.max_new_tokens < 1:
            raise ConfigError(f"task.sample_prompts must be 0 or more and task.max_new_tokens at least 1, got "
                              f"{self.sample_prompts} and {self.max_new_tokens}.")
        if self.loss_chunk < 0:
            raise ConfigError(f"task.loss_chunk must be 0 (the plain loss) or a number of positions, got "
                              f"{self.loss_chunk}.")
        if self.train_on is TrainOn.completion and self.format in (DataFormat.messages, DataFormat.text):
            raise ConfigError(f"task.train_on=completion needs prompt/completion data, and task.format="
                              f"{self.format.value}; use task.train_on=assistant or last_assistant.")
        if self.streaming and not str(self.data_files.train).lower().endswith(".jsonl"):
            raise ConfigError("task=sft with task.streaming=true reads a JSON Lines file line by line: give "
                              "task.data_files.train=<.jsonl file>.")
