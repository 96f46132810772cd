"""Parameter-efficient fine-tuning with peft (``adapter=lora``): LoRA adapters on the task's model.

peft wraps the model (``get_peft_model``): the model's own weights are frozen, each targeted module
gets a pair of low-rank matrices, and a classification head (what peft's ``SEQ_CLS`` task type keeps
trainable: a module named ``classifier`` or ``score``) trains whole. The engine then sees an ordinary
module: the Accelerator prepares it (DDP, FSDP2, SPMD), autocast covers it, and checkpoints hold its
whole state (the frozen weights, the adapters, the head) and its optimizer's (the trainable
parameters only), so a resumed run continues bit for bit.

peft's task type follows the model, so this works for any task with a Transformers model: what the
task declares (:class:`app.tasks.base.DeclaresAdapterTaskType`), else the model's class name
(``…ForSequenceClassification``: ``SEQ_CLS``, ``…ForCausalLM``: ``CAUSAL_LM``, …), else none (peft's
plain ``PeftModel``, for any module, with ``adapter.target_modules`` named). ``adapter.target_modules``
null takes peft's defaults for the model type (that of the model, or of the first Transformers model
inside it: our mean-pooling classifier's encoder).

The export (:func:`export_adapter`, on the main process) rebuilds the model on the CPU, loads the
trained state into it, and writes peft's adapter folder with ``save_pretrained`` (``model/adapter/``,
which ``PeftModel.from_pretrained(base, folder)`` loads) and, with ``adapter.merge_on_export``, the
adapters merged into the weights (``merge_and_unload``): ``model/`` then loads with plain
``from_pretrained``. Both come from the same trained state, so they predict alike.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import AdapterConfig, ConfigError, LoraAdapterConfig, require_package
from app.distributed.checkpoint.export import shard, tied_targets, write_weights
from app.distributed.checkpoint.format import dedupe_shared
from app.engine.checkpoint_resume import ADAPTER_CONFIG_FILE, has_model_weights
from app.run_folder.layout import adapter_dir
from app.tasks.base import DeclaresAdapterTaskType, Task

if TYPE_CHECKING:
    import peft

log = logging.getLogger(__name__)

PEFT_TASK_TYPES = (("ForSequenceClassification", "SEQ_CLS"), ("ForCausalLM", "CAUSAL_LM"),
                   ("ForTokenClassification", "TOKEN_CLS"), ("ForQuestionAnswering", "QUESTION_ANS"),
                   ("ForSeq2SeqLM", "SEQ_2_SEQ_LM"))
"""peft's task type by the end of a Transformers class name (the first that matches)."""
ALL_LINEAR = "all-linear"
"""peft's shortcut: every linear layer but the output head."""


def _peft() -> Any:
    """The peft package, or the sentence naming the extra (a config that skipped validation meets it here)."""
    require_package("peft", "adapter=lora", "peft", "use adapter=none")
    import peft

    return peft


def peft_task_type(task: Task, model: nn.Module) -> str | None:
    """peft's task type: the task's declaration, else the model class's name, else None (a plain PeftModel)."""
    if isinstance(task, DeclaresAdapterTaskType):
        return task.peft_task_type
    name = type(model).__name__
    return next((kind for suffix, kind in PEFT_TASK_TYPES if name.endswith(suffix)), None)


def default_target_modules(model: nn.Module) -> list[str] | None:
    """peft's LoRA targets for the model's type: the model's own, else those of the first Transformers
    model inside it (a custom head on an encoder); None when peft knows none."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    for module in model.modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if model_type in DEFAULTS:
            return list(DEFAULTS[model_type])
    return None


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what a user would put in target_modules)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Each target must name a module the way peft matches a list: the whole name or its end."""
    names = [name for name, _ in model.named_modules() if name]
    for target in targets:
        if target == ALL_LINEAR:
            continue
        if not any(name == target or name.endswith(f".{target}") for name in names):
            raise ConfigError(
                f"adapter.target_modules has {target!r}, which names no module of {type(model).__name__} (peft matches "
                f"a module's name or its end; its linear layers are named {', '.join(linear_layer_names(model))}).")


def lora_config(cfg: LoraAdapterConfig, task: Task, model: nn.Module) -> peft.LoraConfig:
    peft = _peft()
    targets = list(cfg.target_modules) if cfg.target_modules is not None else default_target_modules(model)
    if targets is None:
        raise ConfigError(
            f"adapter.target_modules=null takes peft's default LoRA targets for the model type, and peft has none for "
            f"{type(model).__name__}; name them, e.g. adapter.target_modules=[{', '.join(linear_layer_names(model)[:2])}] "
            f"(its linear layers: {', '.join(linear_layer_names(model))}).")
    check_targets(model, targets)
    return peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
                           task_type=peft_task_type(task, model))


def attach_adapter(model: nn.Module, cfg: AdapterConfig, task: Task, saved: Path | None = None) -> nn.Module:
    """The model to train: ``model`` itself (``adapter=none``), or peft's model with new LoRA adapters
    (``adapter=lora``), or with the adapters of a saved adapter folder (``saved``: mode=eval of an
    export without merged weights). Before the model is prepared: DDP and FSDP2 must see the frozen
    parameters as frozen."""
    if saved is not None:
        # Trainable, as in training: the engine builds an optimizer over the trainable parameters.
        return _peft().PeftModel.from_pretrained(model, str(saved), is_trainable=True)
    if not isinstance(cfg, LoraAdapterConfig):
        return model
    config = lora_config(cfg, task, model)
    try:
        return _peft().get_peft_model(model, config)
    except (ValueError, TypeError) as err:  # e.g. a target that is a module of a kind LoRA cannot adapt
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"peft cannot put LoRA adapters on {type(model).__name__} with adapter.target_modules="
                          f"{list(cfg.target_modules) if cfg.target_modules else 'null'}: {first}") from None


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (asked without importing peft)."""
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def describe(model: nn.Module) -> str:
    """The model's class, and its adapters when it has some (the model summary's first words)."""
    if not is_adapted(model):
        return type(model).__name__
    base = model.get_base_model()  # type: ignore[operator]
    config: Any = model.peft_config["default"]  # type: ignore[index]
    targets = config.target_modules
    targets = ", ".join(sorted(targets)) if isinstance(targets, (set, list, tuple)) else str(targets)
    return (f"{type(base).__name__} with LoRA adapters (r={config.r}, alpha={config.lora_alpha:g}, "
            f"dropout={config.lora_dropout:g}) on {targets}")


def saved_adapter(folder: Path, adapted: bool) -> Path | None:
    """The adapter folder mode=eval puts on the task's model, if any: the export's ``adapter/`` when the
    run's config has adapters (``adapted``: the model is then as in training, so what the task does with
    them works — task=dpo's ``reference=base`` disables them), or when the export holds no merged
    weights of its own (``adapter.merge_on_export=false``). Its merged weights predict alike."""
    adapter = adapter_dir(folder)
    return adapter if (adapter / ADAPTER_CONFIG_FILE).is_file() and (adapted or not has_model_weights(folder)) else None


def export_adapter(task: Task, cfg: LoraAdapterConfig, trained: dict[str, torch.Tensor], folder: Path,
                   max_shard_size: int | str = "10GB") -> nn.Module:
    """Main process: write ``folder/adapter/`` (peft's ``save_pretrained``) and, with ``merge_on_export``,
    the merged weights into ``folder``, from ``trained`` (the prepared model's full state, gathered);
    returns the model whose files the task writes beside them (``save_artifacts``): the merged model,
    or the base model without merged weights.

    The model is rebuilt on the CPU as the task builds it, the random streams left as they were, and
    gets every trained tensor: frozen weights the checkpoint started from at random (a new head) come
    from the run too, not from a new draw."""
    with torch.random.fork_rng(devices=[]):
        rebuilt = attach_adapter(task.build_model(), cfg, task)
    missing, unexpected = rebuilt.load_state_dict({k: v.detach().cpu() for k, v in trained.items()}, strict=False)
    # Only tensors that share memory with another one may be absent (tied weights are gathered once).
    shared = {k for k, v in rebuilt.state_dict().items() for o, w in rebuilt.state_dict().items()
              if o != k and v.data_ptr() == w.data_ptr()}
    if unexpected or set(missing) - shared:
        raise RuntimeError(f"the rebuilt adapter model does not match the trained one (missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]})")
    rebuilt.eval()
    rebuilt.save_pretrained(str(adapter_dir(folder)))  # type: ignore[operator]
    if not cfg.merge_on_export:
        return rebuilt.get_base_model()  # type: ignore[operator, no-any-return]
    merged: nn.Module = rebuilt.merge_and_unload()  # type: ignore[operator]
    unique, _ = dedupe_shared(merged.state_dict(), drop_first=tied_targets(merged))
    from app.distributed.checkpoint.export import parse_size

    write_weights(folder, shard(unique, parse_size(max_shard_size)), safe=True, each_file_atomic=False)
    return merged
