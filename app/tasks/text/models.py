"""Tokenizers and classifiers from a local folder or the hub, with the checks that name what is wrong.

A damaged ``config.json``, a tokenizer without its vocabulary files, or a model name that is neither
a folder nor reachable each end in one sentence (ConfigError) instead of a transformers traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from app.config import ConfigError
from app.tasks.text.config import Pooling
from app.tasks.text.hub import hub_access
from app.tasks.text.labels import LabelSet
from app.tasks.text.metrics import Problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

MAX_UNKNOWN_RATE = 0.05
"""Share of a data sample's tokens that may be the tokenizer's unknown token; above it the tokenizer
does not fit the data (missing vocabulary files, another language) and training would learn nothing."""


def check_tokenizer_covers(tokenizer: PreTrainedTokenizerBase, name: str, train: Any, text_columns: Sequence[str],
                           sample: int = 200) -> None:
    """Refuse a tokenizer that maps much of the first training rows' text to its unknown token."""
    unknown = tokenizer.unk_token_id
    if unknown is None:
        return  # byte-level tokenizers encode anything
    rows = train.select(range(min(sample, len(train))))
    texts = [text for column in text_columns for text in rows[column]]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    total = sum(len(i) for i in ids)
    rate = sum(i.count(unknown) for i in ids) / max(total, 1)
    if rate > MAX_UNKNOWN_RATE:
        hint = (f"it has only {len(tokenizer)} tokens: are its vocabulary files (vocab.txt, tokenizer.json) missing?"
                if len(tokenizer) <= len(tokenizer.all_special_tokens) + 1
                else "is it the tokenizer the model was trained with?")
        items = "pairs" if len(text_columns) == 2 else "texts"
        raise ConfigError(f"the tokenizer in {name} encodes {rate:.0%} of the tokens of the first {len(rows)} training "
                          f"{items} as {tokenizer.unk_token}; {hint}")


def check_config_json(name: str) -> None:
    """A local model folder's config.json must parse (else transformers blames the tokenizer)."""
    config = Path(name).expanduser() / "config.json"
    if not config.is_file():
        return
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{config} is not valid JSON ({first}); the model folder's configuration is damaged.") from None


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    check_config_json(name)
    try:
        with hub_access(name):
            return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"Could not load the tokenizer {name!r}, which is neither a local tokenizer folder nor "
            "reachable on the hub; set task.tokenizer (or task.model) to a local folder."
        ) from e


PROBLEM_TYPES = {Problem.single_label: "single_label_classification", Problem.regression: "regression",
                 Problem.multi_label: "multi_label_classification"}
"""transformers' ``problem_type`` of each problem: its pipelines read it to choose softmax, sigmoid or none."""


def load_model(name: str, labels: LabelSet, pooling: Pooling = Pooling.cls) -> nn.Module:
    """The classifier over ``labels`` (one output for a regression): the model's own head (``cls``)
    or a mean-pooling head on its encoder.

    A folder exported with the mean-pooling head loads as such whatever ``pooling`` says: the head
    is part of that model.
    """
    from transformers import AutoModel, AutoModelForSequenceClassification

    from app.tasks.text import mean_pooling

    check_config_json(name)
    config: dict[str, Any] = {
        "num_labels": labels.num_outputs,
        "id2label": dict(enumerate(labels.names)),
        "label2id": {label: i for i, label in enumerate(labels.names)},
        "problem_type": PROBLEM_TYPES[labels.problem],
    }
    # A checkpoint fine-tuned with another number of labels (an MNLI model, 3, on 5 classes) keeps its
    # encoder and gets a new head; transformers names the weights it initialised.
    head = {**config, "ignore_mismatched_sizes": True}
    try:
        with hub_access(name):
            if _model_type(name) == mean_pooling.MeanPoolingConfig.model_type:
                return mean_pooling.MeanPoolingForSequenceClassification.from_pretrained(name, **head)
            if pooling is Pooling.cls and _trained_with_mean_pooling(name):
                log.info("%s is a sentence-transformers model trained with mean pooling: task.pooling=mean "
                         "usually fine-tunes it better than its [CLS] head.", name)
            if pooling is Pooling.mean:
                encoder = AutoModel.from_pretrained(name)
                return mean_pooling.MeanPoolingForSequenceClassification.from_encoder(encoder, **config)
            return AutoModelForSequenceClassification.from_pretrained(name, **head)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"Could not load the model {name!r}, which is neither a local folder with config.json and "
            "weights nor reachable on the hub; set task.model to a local model folder."
        ) from e


def _trained_with_mean_pooling(name: str) -> bool:
    """Does a local sentence-transformers folder say its embeddings are mean-pooled?"""
    for config in Path(name).expanduser().glob("*_Pooling/config.json"):
        try:
            return bool(json.loads(config.read_text(encoding="utf-8")).get("pooling_mode_mean_tokens"))
        except (OSError, ValueError, AttributeError):
            return False
    return False


def _model_type(name: str) -> str | None:
    """``model_type`` from a local folder's config.json (None for hub names and unreadable files)."""
    config = Path(name).expanduser() / "config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
