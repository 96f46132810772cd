"""The weights of the best evaluation, kept whatever the checkpoint schedule, so that
``checkpoint.export=best`` always exports the best evaluation.

When an evaluation improves on the best (early stopping's rule: the first evaluation to reach the best
value), the weights it evaluated are kept: the weight average with ``trainer.ema_decay``, and only what
trains (a LoRA model's adapters and head; frozen weights never change). A checkpoint of that very step,
when one follows the evaluation (its epoch's end with ``checkpoint.every_epoch``, the run's last step
with checkpoints on), holds them already; otherwise they go to ``checkpoints/best_<step>/``
(``Accelerator.save_weights``: committed as a checkpoint is, in the background with
``checkpoint.async_save``, each rank its shards on FSDP2). The previous best's folder goes once the new
one is complete.

A best's weights are needed while it is the run's best and while a checkpoint that a resume may start
from records it as its best (the manifest's ``best_step``: that run's export needs it). A checkpoint
holding needed weights that rotation removes (beyond ``checkpoint.total_limit``) leaves them in
``checkpoints/best_<step>/`` first (:meth:`BestWeights.keep_from_checkpoint`), so the limit bounds the
resumable checkpoints and no optimizer state is kept for an export; with ``trainer.ema_decay`` such a
checkpoint is kept whole (its weight average, not its model's weights, is what was evaluated).
:meth:`BestWeights.prune` removes the folders no longer needed, on the main process once a save is
complete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config import CheckpointConfig
from app.distributed.checkpoint import best
from app.distributed.checkpoint.store import Manifest, complete_checkpoints
from app.engine.loop import Components, LoopState, batches_per_pass
from app.engine.triggers import EarlyStopping

log = logging.getLogger(__name__)

BEST_STEP = "best_step"
"""A checkpoint manifest's ``extra`` key: the step of its run's best evaluation when it was saved."""


class BestWeights:
    """Keeps the best evaluation's weights for a run folder's ``checkpoints/`` (``root``)."""

    def __init__(self, c: Components, root: Path, cfg: CheckpointConfig, stopper: EarlyStopping, total_steps: int,
                 manifest_fields: Callable[[LoopState], dict[str, Any]], on_complete: Callable[[Path], None]):
        self.c, self.acc, self.root, self.cfg, self.stopper = c, c.accelerator, root, cfg, stopper
        self.total_steps = total_steps
        self.manifest_fields = manifest_fields
        """step, epoch, config hash and metric of the state, for the kept folder's manifest."""
        self.on_complete = on_complete
        """Called with a kept folder once it is complete, on the main process (the policy rotates and prunes)."""

    def after_evaluation(self, state: LoopState) -> None:
        """After an evaluation and the checkpoint policy's turn at its step, which saved nothing: keep
        the evaluated weights if it is the new best, unless a checkpoint of this step still follows."""
        if self.stopper.best_step != state.global_step or state.last_eval_step != state.global_step:
            return
        if self.checkpoint_follows(state):
            return
        with self.c.evaluation_weights():
            # Staged inside: the average is in the model only here (a synchronous save is written here too).
            self.acc.save_weights(self.c.model, best.folder(self.root, state.global_step), trainable_only=True,
                                  metadata=self.manifest_fields(state), async_save=self.cfg.async_save,
                                  on_complete=self.on_complete)

    def checkpoint_follows(self, state: LoopState) -> bool:
        """Whether this run still saves a checkpoint of this step (its weights then hold this
        evaluation's): the epoch ends here with ``every_epoch``, or training does, with checkpoints on
        (the final state's; a stop of any kind ends there too)."""
        if not self.cfg.enabled:
            return False
        if state.global_step >= self.total_steps:
            return True
        batches = batches_per_pass(self.c.train_loader)
        return self.cfg.every_epoch and batches is not None and state.batches_in_epoch >= batches

    # -- on the main process, once a save is complete ----------------------------------------------------
    def needed_steps(self, best_step: int | None) -> set[int]:
        """The steps whose best weights are needed: the run's best (``best_step``) and the best each
        remaining checkpoint recorded."""
        needed = {step for _, manifest in complete_checkpoints(self.root)
                  if isinstance(step := manifest.extra.get(BEST_STEP), int)}
        return needed | ({best_step} if best_step is not None else set())

    @property
    def keep_from_checkpoint(self) -> Callable[[Path, Manifest], None] | None:
        """What rotation calls for a checkpoint it removes whose weights are still needed: keeps them as
        ``best_<step>``. None with a weight average: the checkpoint is kept whole (its model file holds
        the trained weights, not the averaged ones that were evaluated)."""
        if self.c.weight_average is not None:
            return None

        def keep(checkpoint: Path, manifest: Manifest) -> None:
            kept_in = best.from_checkpoint(self.root, checkpoint, manifest)
            log.debug("kept the weights of %s (step %d) as %s: a best evaluation still needs them",
                      checkpoint.name, manifest.step, kept_in.name)

        return keep

    def prune(self, needed: set[int]) -> None:
        for removed in best.prune(self.root, needed):
            log.debug("removed %s, the weights of an earlier best evaluation", removed.name)


# -- the export ----------------------------------------------------------------------------------------
def holder(root: Path, value: float, step: int | None, monitor: str) -> tuple[Path, Manifest] | None:
    """The folder of ``root`` holding the best evaluation's weights (``monitor`` = ``value`` at ``step``;
    None: a checkpoint from before steps were recorded): the checkpoint of its step, else its kept
    weights. Main process."""
    for path, saved in complete_checkpoints(root):
        if saved.metric_value() == value and (saved.metric or {}).get("name") == monitor and step in (None, saved.step):
            return path, saved
    return best.find(root, step, monitor, value) if step is not None else None


def load_kept(c: Components, folder: Path) -> None:
    """Put kept weights into the model (every process). They are the evaluated ones, so the weight
    average, which evaluation and export apply, becomes them too."""
    c.accelerator.load_weights(c.model, folder)
    if c.weight_average is not None:
        c.weight_average.take_weights()
