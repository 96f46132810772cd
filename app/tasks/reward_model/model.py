"""The reward model: ``AutoModelForSequenceClassification`` with one label on the causal language model of
``task.model`` (its body's weights, a new ``score`` head drawn from the run's seed) or of ``task.config``
(all new), and the padding token it reads its scores by.

A Transformers sequence classifier keeps, of its head's per-token scores, the one at the rightmost token
that is not its ``pad_token_id``. Training reads the score at each sequence's last real token
(``scores.py``); the two agree only if no sequence ends with the padding token. A tokenizer without one,
or whose padding token is a token sequences end with (its EOS, which ends plain-text rows; the chat
template's end-of-turn token), gets a padding token of its own (:data:`PAD_TOKEN`, the vocabulary grown by
one), said in the log; the model's configuration records its id, so the export scores as training did.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from app.config import ConfigError
from app.tasks.causal_lm.models import build_config, load_model, model_source
from app.tasks.reward_model.config import RewardModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

PAD_TOKEN = "<|pad|>"


def give_padding_token(tokenizer: PreTrainedTokenizerBase, ending: dict[str, int | None], source: str) -> None:
    """Give ``tokenizer`` a padding token of its own where it has none, or where its own is one of the
    tokens that end sequences (``ending``: by name, e.g. ``{"EOS": 2}``)."""
    pad = tokenizer.pad_token_id
    clash = next((name for name, token in ending.items() if token is not None and token == pad), None)
    if pad is not None and clash is None:
        return
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    why = ("has no padding token" if pad is None else
           f"pads with its {clash} {tokenizer.convert_ids_to_tokens(pad)}, which ends sequences")
    log.info("the tokenizer of %s %s: %s (id %d) pads instead, so that a sequence classifier's own pooling (its "
             "rightmost token that is not padding) reads the score where training does, at the last real token",
             source, why, PAD_TOKEN, tokenizer.pad_token_id)


def load_reward_model(cfg: RewardModelConfig, tokenizer: PreTrainedTokenizerBase) -> nn.Module:
    """``AutoModelForSequenceClassification`` with one label, its ``pad_token_id`` the tokenizer's, in float32."""
    from transformers import AutoModelForSequenceClassification

    config = build_config(cfg)
    classifier = any(str(a).endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or [])
    if classifier and config.num_labels != 1:
        raise ConfigError(f"{model_source(cfg)} is a sequence classifier with {config.num_labels} labels; a reward "
                          "model has one: give the causal language model to train it from (or a reward model).")
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    config.get_text_config().pad_token_id = tokenizer.pad_token_id
    return load_model(cfg, tokenizer, grow_vocabulary=True, auto_class=AutoModelForSequenceClassification,
                      config=config)
