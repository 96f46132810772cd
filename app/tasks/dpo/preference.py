"""What the preference tasks share (``task=dpo``, ``task=kto``): ``task=sft``'s model, tokenizer, chat
template and export; the reference model ``task.reference`` chooses (``reference.py``), and TR-DPO's
synchronisation of it (``task.sync_ref_every``: after every that many optimizer steps the reference
moves towards the policy; the moved reference is saved with every checkpoint, so a resumed run goes on
exactly); the forward pass whose logits give each sequence's log-probabilities (``logps.py``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import TaskRuntime
from app.tasks.causal_lm.models import flops_per_token, load_model, model_source
from app.tasks.dpo.config import PreferenceConfig, Reference
from app.tasks.dpo.reference import AdaptersDisabled, FrozenCopy, Precomputed
from app.tasks.sft.attention import check_isolation, model_inputs, use_eager_attention
from app.tasks.sft.task import SFTTask

log = logging.getLogger(__name__)


class PreferenceTask(SFTTask):
    """``SFTTask`` with a reference model beside the policy (none for a reference-free objective)."""

    def __init__(self, cfg: PreferenceConfig, reference_free: bool = False):
        super().__init__(cfg)
        self.cfg: PreferenceConfig = cfg
        self.conversational = False
        self.reference_free = reference_free
        """No reference model is loaded and none runs (SimPO, CPO, ORPO)."""
        self._runtime: TaskRuntime | None = None
        """``build_data``'s runtime: ``build_model`` prepares the reference model with it."""
        base = not reference_free and cfg.reference_mode is Reference.base
        self.reference: FrozenCopy | AdaptersDisabled | Precomputed | None = AdaptersDisabled() if base else None
        self._sync_checked = False

    def build_model(self) -> nn.Module:
        cfg = self.cfg
        model = load_model(cfg, self.tokenizer, grow_vocabulary=True)
        self._flops_per_token = flops_per_token(model, cfg.block_size)
        if self._explicit_mask:
            use_eager_attention(model)  # before the copy: the reference runs the same attention
        if cfg.packing:
            check_isolation(model, self._explicit_mask)
        mode = cfg.reference_mode
        if self.reference_free:
            log.info("no reference model: the objective reads the policy's log-probabilities alone (one model in "
                     "memory, no reference pass)")
        elif mode in (Reference.copy, Reference.folder) and self.reference is None:
            # Before any adapter: the starting weights. Once: an adapter's export rebuilds the model on
            # the main process alone, and preparing a copy under FSDP2 takes every process.
            if self._runtime is None:
                raise RuntimeError("build_data() keeps the runtime that prepares the reference model; call it first.")
            own = mode is Reference.folder
            self.reference = FrozenCopy(self._reference_model(model) if own else model, self._runtime, copied=not own)
            if cfg.sync_ref_every is not None:  # it moves: every checkpoint holds it
                self._runtime.register_for_checkpointing(self.reference.model)
        return model

    def _reference_model(self, policy: nn.Module) -> nn.Module:
        """``task.reference=<folder>``'s model, loaded as the policy is (the tokenizer's tokens added to its
        vocabulary alike); refused unless its weights have the policy's shapes."""
        cfg = self.cfg
        model = load_model(dataclasses.replace(cfg, model=cfg.reference, config=None), self.tokenizer,
                           grow_vocabulary=True)
        shapes = [tuple(p.shape) for p in model.parameters()]
        if shapes != [tuple(p.shape) for p in policy.parameters()]:
            raise ConfigError(f"task.reference={cfg.reference} is not the policy's architecture ({len(shapes)} weights "
                              f"of other shapes than {model_source(cfg)}'s); give a model of the same architecture and "
                              "vocabulary.")
        if self._explicit_mask:
            use_eager_attention(model)
        log.info("reference model: %s (task.reference), frozen", cfg.reference)
        return model

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        """TR-DPO: every ``task.sync_ref_every`` steps, ``ref ← α·policy + (1-α)·ref``."""
        every = self.cfg.sync_ref_every
        if every is not None and step % every == 0 and isinstance(self.reference, FrozenCopy):
            self.reference.move_towards(model, self.cfg.sync_ref_alpha)

    def _check_sync(self, model: nn.Module) -> None:
        """At the first training step: TR-DPO mixes the policy's weights into the reference's, which the
        trained model must then have (not adapters beside frozen weights)."""
        self._sync_checked = True
        if self.cfg.sync_ref_every is not None and any(type(m).__module__.startswith("peft.") for m in model.modules()):
            raise ConfigError("task.sync_ref_every mixes the policy's weights into the reference's, and with "
                              "adapter=lora the policy's weights do not train; leave task.sync_ref_every null "
                              "(or train the whole model).")

    def _logits(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The model's logits for a batch (a packed one's positions and, on XLA, its explicit mask)."""
        if model.training and not self._sync_checked:
            self._check_sync(model)
        dtype = model.get_input_embeddings().weight.dtype if self._explicit_mask else torch.float32  # type: ignore[operator]
        return model(**model_inputs(batch, self._explicit_mask, dtype), use_cache=False).logits

    def _reference_facts(self) -> str:
        """What the model card says of the reference."""
        cfg = self.cfg
        if self.reference_free:
            return "none (reference-free)"
        said = cfg.reference if cfg.reference_mode is Reference.folder else cfg.reference_mode.value
        if cfg.sync_ref_every is not None:
            said += f", moved towards the policy every {cfg.sync_ref_every} steps (α = {cfg.sync_ref_alpha})"
        return said
