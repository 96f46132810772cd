"""Sequence classification on the mean of an encoder's token states (``task.pooling=mean``).

Transformers' ``*ForSequenceClassification`` heads read the first token (BERT: ``[CLS]`` through a
dense+tanh "pooler"). Sentence-transformers checkpoints such as all-MiniLM-L6-v2 were trained with
mean pooling instead: their ``[CLS]`` state and pooler carry little, while the mean of the token
states is the representation they were built to produce. A linear classifier on that mean starts
from a useful feature instead of re-learning one (on GLUE MRPC: 0.80 accuracy after one epoch
instead of 0.75).

This file is self-contained (torch and transformers only) on purpose: the export copies it next to
the weights and ``config.json`` names it in ``auto_map``, so
``AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)`` loads the
model anywhere, without this application installed. Its own ``model_type`` makes loading without
``trust_remote_code`` fail loudly instead of silently building a ``[CLS]`` head on these weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

MODULE_FILE = "mean_pooling.py"
"""Name under which this file is copied into an exported model folder (``auto_map`` points at it)."""


class MeanPoolingConfig(PretrainedConfig):
    model_type = "mean_pooling_classifier"

    def __init__(self, encoder: dict[str, Any] | None = None, classifier_dropout: float = 0.1,
                 initializer_range: float = 0.02, **kwargs: Any):
        super().__init__(**kwargs)
        self.encoder = dict(encoder or {})
        """The encoder's own config as a dict (with its ``model_type``)."""
        self.classifier_dropout = classifier_dropout
        self.initializer_range = initializer_range

    def encoder_config(self) -> PretrainedConfig:
        values = dict(self.encoder)
        return AutoConfig.for_model(values.pop("model_type"), **values)


class MeanPoolingForSequenceClassification(PreTrainedModel):
    config_class = MeanPoolingConfig
    base_model_prefix = "encoder"
    # gradient_checkpointing_enable() reaches the encoder's layers, which recompute themselves.
    supports_gradient_checkpointing = True

    def __init__(self, config: MeanPoolingConfig, encoder: PreTrainedModel | None = None):
        super().__init__(config)
        # from_pretrained passes no encoder: one is built from the config, then the weights load.
        self.encoder = encoder if encoder is not None else AutoModel.from_config(config.encoder_config())
        _drop_pooler(self.encoder)
        # FSDP2 shards the encoder's repeated blocks, as it would for the encoder's own heads.
        self._no_split_modules = list(getattr(self.encoder, "_no_split_modules", None) or [])
        self.dropout = nn.Dropout(config.classifier_dropout)
        # transformers types num_labels as Optional; its default is 2.
        self.classifier = nn.Linear(self.encoder.config.hidden_size, config.num_labels or 2)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Only the head is new: the encoder's weights come from its checkpoint or from ours.
        if module is self.classifier:
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            nn.init.zeros_(module.bias)

    @classmethod
    def from_encoder(cls, encoder: PreTrainedModel, **config_kwargs: Any) -> MeanPoolingForSequenceClassification:
        """A new classifier on a pretrained encoder (e.g. ``AutoModel.from_pretrained(name)``)."""
        config = MeanPoolingConfig(encoder=encoder.config.to_dict(), **config_kwargs)
        return cls(config, encoder=encoder)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **encoder_inputs: Any) -> SequenceClassifierOutput:
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **encoder_inputs).last_hidden_state
        if attention_mask is None:
            pooled = states.mean(dim=1)
        else:
            mask = attention_mask.unsqueeze(-1).to(states.dtype)
            pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.float(), labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def _drop_pooler(encoder: nn.Module) -> None:
    """The ``[CLS]`` pooler is unused here; left in, DDP would wait for its gradients forever."""
    if getattr(encoder, "pooler", None) is not None:
        encoder.pooler = None  # type: ignore[assignment]


def auto_map() -> dict[str, str]:
    """What ``config.json`` needs so that the Auto classes find the classes in the copied file."""
    stem = MODULE_FILE.removesuffix(".py")
    return {
        "AutoConfig": f"{stem}.{MeanPoolingConfig.__name__}",
        "AutoModelForSequenceClassification": f"{stem}.{MeanPoolingForSequenceClassification.__name__}",
    }
