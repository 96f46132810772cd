"""The causal language model: pretrained (``task.model``) or randomly initialised from a configuration
(``task.config``: a folder with ``config.json``, a hub name, or a model type), with the checks that
name what is wrong; and its training FLOPs per token, for the throughput log's MFU."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.causal_lm.config import CausalLMConfig
from app.tasks.text.hub import hub_access
from app.tasks.text.models import check_config_json, load_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def model_source(cfg: CausalLMConfig) -> str:
    """The folder or name the model (and by default its tokenizer) comes from."""
    source = cfg.model if cfg.model is not None else cfg.config
    assert source is not None  # the schema's check: one of the two is given
    return source


def load_lm_tokenizer(cfg: CausalLMConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of every language-model task (``task.tokenizer``, else the model's). One without an
    EOS token gets the one the model's configuration names (``eos_token_id``), said once in the log:
    documents end with EOS, packing separates them with it and generation stops at it, so the model's
    own end token is the one to use, rather than none."""
    source = cfg.tokenizer or model_source(cfg)
    tokenizer = load_tokenizer(source)
    if tokenizer.eos_token_id is None:
        eos_of_the_model(tokenizer, cfg, source)
    return tokenizer


def eos_of_the_model(tokenizer: PreTrainedTokenizerBase, cfg: CausalLMConfig, source: str) -> None:
    """Set the tokenizer's EOS to the token the model's configuration names, when it names one the
    tokenizer has (a list: its first). A model type's defaults (``task.config=llama``) name no model's token."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model = model_source(cfg)
    if cfg.model is None and not Path(model).expanduser().exists() and model in CONFIG_MAPPING:
        return
    named = build_config(cfg).eos_token_id
    eos = named[0] if isinstance(named, (list, tuple)) and named else named
    if not isinstance(eos, int) or not 0 <= eos < len(tokenizer):
        return
    token = tokenizer.convert_ids_to_tokens(eos)
    tokenizer.eos_token = token
    log.info("the tokenizer of %s has no EOS token; the model's configuration names %s (id %d): using it as EOS",
             source, token, eos)


def build_config(cfg: CausalLMConfig) -> PretrainedConfig:
    """The model's configuration, ``task.config_overrides`` applied."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    source = model_source(cfg)
    overrides = dict(cfg.config_overrides)
    if cfg.model is None and not Path(source).expanduser().exists() and source in CONFIG_MAPPING:
        return AutoConfig.for_model(source, **overrides)  # a model type with its defaults
    check_config_json(source)
    try:
        with hub_access(source):
            config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        key = "task.model" if cfg.model is not None else "task.config"
        raise ConfigError(f"Could not load a model configuration from {key}={source!r}, which is neither a local folder "
                          "with config.json, a model type (llama, gpt2...) nor reachable on the hub.") from err
    for name, value in overrides.items():
        if not hasattr(config, name):
            raise ConfigError(f"task.config_overrides has {name!r}, which the {config.model_type} configuration does "
                              "not have.")
        setattr(config, name, value)
    return config


def load_model(cfg: CausalLMConfig, tokenizer: PreTrainedTokenizerBase, grow_vocabulary: bool = False,
               auto_class: Any = None, config: PretrainedConfig | None = None) -> nn.Module:
    """``AutoModelForCausalLM``: the pretrained weights, or a new model drawn from torch's random
    stream (the run's seed); in float32 (precision is the runtime's: autocast). ``grow_vocabulary``:
    a tokenizer with more tokens than the model (tokens the task added, task=sft's ChatML markers)
    grows its embeddings (the new rows: Transformers' mean of the others) instead of being refused.
    ``auto_class``: another Transformers auto class on the same body (task=reward_model's
    ``AutoModelForSequenceClassification``), with ``config`` (:func:`build_config`'s, changed for it)."""
    from transformers import AutoModelForCausalLM

    auto_class = auto_class or AutoModelForCausalLM
    config = build_config(cfg) if config is None else config
    grow = grow_vocabulary and len(tokenizer) > config.vocab_size
    if grow:
        log.info("the model's vocabulary grows from %d to the tokenizer's %d tokens", config.vocab_size, len(tokenizer))
        if cfg.model is None:
            config.vocab_size = len(tokenizer)
    elif len(tokenizer) > config.vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens and the model's vocabulary only "
                          f"{config.vocab_size}; give the model's own tokenizer (task.tokenizer) or a larger "
                          "vocab_size (task.config_overrides).")
    tokens_of_the_tokenizer(config, tokenizer, new_model=cfg.model is None)
    attention = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
    if cfg.model is None:
        return attention_checked(lambda: auto_class.from_config(config, dtype=torch.float32, **attention), cfg)
    source = cfg.model
    try:
        with hub_access(source):
            model: Any = attention_checked(lambda: auto_class.from_pretrained(
                source, config=config, dtype=torch.float32, **attention), cfg)
    except ConfigError:
        raise
    except (OSError, ValueError) as err:
        raise ConfigError(f"Could not load the model {cfg.model!r}, which is neither a local folder with config.json "
                          "and weights nor reachable on the hub; set task.model to a local model folder.") from err
    if grow:
        model.resize_token_embeddings(len(tokenizer))
    generation = getattr(model, "generation_config", None)
    if generation is not None and not _holds(generation.eos_token_id, tokenizer.eos_token_id):
        generation.eos_token_id = config.eos_token_id  # its saved generation_config.json: stop where training did
    return model


def attention_checked(build: Callable[[], nn.Module], cfg: CausalLMConfig) -> nn.Module:
    """``build()``, with Transformers' refusal of ``task.attn_implementation`` (a package not installed, a
    model without it) said in one sentence."""
    try:
        return build()
    except (ImportError, ValueError) as err:
        if cfg.attn_implementation is None or "attention" not in str(err).lower():
            raise  # not the attention's refusal
        raise ConfigError(f"task.attn_implementation={cfg.attn_implementation} cannot be used here: "
                          f"{str(err).splitlines()[0]}") from None


def _holds(ids: int | list[int] | None, token: int | None) -> bool:
    return token == ids or (isinstance(ids, list) and token in ids)


def tokens_of_the_tokenizer(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, new_model: bool) -> None:
    """The model's EOS (and, for a new model, BOS) token ids are the tokenizer's: every training document
    ends with the tokenizer's EOS, so generation must stop there (the export's ``generation_config.json``
    says so). A configuration that says otherwise (a model type's defaults, a config folder made apart
    from its tokenizer) is changed, and the log says so."""
    changed = []
    names = ("eos", "bos") if new_model else ("eos",)
    for name in names:
        token = getattr(tokenizer, f"{name}_token_id")
        key = f"{name}_token_id"
        if token is not None and not _holds(getattr(config, key, None), token):
            changed.append(f"{key} {getattr(config, key, None)} -> {token} ({getattr(tokenizer, f'{name}_token')})")
            setattr(config, key, token)
    if changed:
        log.info("the model's special tokens follow its tokenizer's: %s", ", ".join(changed))


def flops_per_token(model: nn.Module, sequence_length: int) -> float:
    """Training FLOPs per token (forward and backward), torchtitan's estimate: 6 per parameter outside
    the embeddings plus the attention's 12 * layers * heads * head dim * sequence length."""
    config: Any = model.config
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    parameters = sum(p.numel() for p in model.parameters()) - embeddings.weight.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return float(6 * parameters + 12 * config.num_hidden_layers * heads * head_dim * sequence_length)
