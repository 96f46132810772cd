"""The chat template a run formats its conversations with: the tokenizer's own, a built-in one by name
(``task.chat_template=chatml``) or a Jinja file. It is set on the tokenizer, so the export's tokenizer
(``save_pretrained``) carries it and ``apply_chat_template`` there formats what training saw."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""ChatML (OpenAI's chat markup, Qwen's and many fine-tunes' format): each turn between ``<|im_start|>role``
and ``<|im_end|>``; the generation prompt opens an assistant turn."""

BUILT_IN: dict[str, tuple[str, tuple[str, ...]]] = {"chatml": (CHATML, ("<|im_start|>", "<|im_end|>"))}
"""Name -> (template, the special tokens it needs)."""


def install_chat_template(tokenizer: PreTrainedTokenizerBase, choice: str | None, source: str) -> str:
    """Set the run's template on ``tokenizer`` and return it. ``choice``: ``task.chat_template`` (None: the
    tokenizer's own); ``source``: where the tokenizer came from, for messages. A built-in template's
    special tokens are added to a tokenizer that lacks them (the model's embeddings then grow)."""
    if choice is None:
        template = tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ConfigError(f"the tokenizer of {source} has no chat template (a base model's); give one: "
                              "task.chat_template=chatml (built in) or task.chat_template=<Jinja file>.")
        return template
    if choice in BUILT_IN:
        template, tokens = BUILT_IN[choice]
        missing = [t for t in tokens if t not in tokenizer.get_vocab()]
        if missing:
            tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
            log.info("the tokenizer gains %s for task.chat_template=%s (%d tokens now)", ", ".join(missing), choice,
                     len(tokenizer))
    else:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise ConfigError(f"task.chat_template={choice} is neither a built-in template ({', '.join(BUILT_IN)}) "
                              "nor a Jinja file.")
        template = path.read_text(encoding="utf-8")
    tokenizer.chat_template = template
    return template
