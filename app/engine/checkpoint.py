"""Checkpoint policy of a training run: when to save (the loop's CheckpointHook), what to keep, which
checkpoint ``resume=`` means, and which weights the final export holds. How checkpoints are written,
verified and read lives in ``app/distributed/checkpoint/``.

- :class:`CheckpointPolicy` saves every ``checkpoint.every_n_steps`` optimizer steps and/or at the
  end of every epoch (after its evaluation), then rotates: the ``total_limit`` newest are kept, plus
  the best by ``early_stopping.monitor`` with ``keep_best``; one rotated out while it holds a best
  evaluation's weights still needed leaves its weights as ``checkpoints/best_<step>`` (not counted). With ``checkpoint.export=best`` an evaluation that improves on the best keeps
  its weights, in ``checkpoints/best_<step>`` when no checkpoint of its step holds them
  (``app.engine.best_weights``). With ``checkpoint.async_save`` a save copies the state and training
  goes on while it is written; rotation runs once it is complete, and the end of training (an
  interrupt included) waits for it.
- :meth:`CheckpointPolicy.resume` restores ``resume=<path>|auto``: weights, optimizer, scheduler,
  RNG states, data position and loop state, so the run continues bit for bit; ``metrics.jsonl`` is
  cut back to what it held at the checkpoint and TensorBoard hides the later events.
- :func:`export_model` writes ``<run folder>/model/``: weights with the model's own key names (a
  Transformers model loads with ``from_pretrained``) plus the task's artifacts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.config import AdapterConfig, ExportChoice, LoraAdapterConfig, RunConfig, as_plain
from app.distributed.checkpoint.atomic import fsync_paths, publish, temporary_sibling
from app.distributed.checkpoint.export import write_weights
from app.distributed.checkpoint.store import (
    Manifest,
    complete_checkpoints,
    fault_point,
    rotate,
    run_folder_of,
)
from app.distributed.checkpoint.training_state import holds_weights_only
from app.engine.adapters import export_adapter
from app.engine.best_weights import BEST_STEP, BestWeights, holder, load_kept
from app.engine.divergence import weights_are_finite
from app.engine.loop import Components, LoopState, batches_per_pass, total_optimizer_steps
from app.engine.progress import human
from app.engine.triggers import EarlyStopping
from app.engine.window_metrics import as_floats, restored
from app.run_folder.layout import (
    CHECKPOINT_PREFIX,
    EXPORT_FILE,
    MODEL_CARD_FILE,
    checkpoints_dir,
    metrics_file,
)

log = logging.getLogger(__name__)


def config_hash(cfg: RunConfig) -> str:
    """What a checkpoint must have been trained with to be resumed: the task (its data and model),
    the optimizer type and, with adapters, their shape (kind, rank, scaling, targets). Folder locations
    (``*_dir`` task fields) and everything else (epochs, learning rate, batch size, processes, the
    adapter's dropout and export) may change on resume."""
    task = {k: v for k, v in as_plain(cfg.task).items() if not k.endswith("_dir")}
    identity: dict[str, Any] = {"task": task, "optimizer": cfg.optim._target_}
    if isinstance(cfg.adapter, LoraAdapterConfig):  # adapter=none hashes as before adapters existed
        identity["adapter"] = {"kind": cfg.adapter.kind.value, "r": cfg.adapter.r, "alpha": cfg.adapter.alpha,
                               "target_modules": cfg.adapter.target_modules}
    payload = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class TrainerState:
    """The engine's part of a checkpoint (registered with the Accelerator): the loop's position and
    counters, early stopping's best value and patience counter, and every rank's partial loss sum
    (each rank sums its own losses between log lines; the main process writes this state)."""

    def __init__(self, loop: LoopState, stopper: EarlyStopping, rank: int, world_size: int):
        self.loop = loop
        self.stopper = stopper
        self.rank, self.world_size = rank, world_size
        self.loss_sums: list[float] = []
        """Set by the policy right before a save: loop.loss_sum of every rank."""
        self.windows: list[dict[str, Any]] = []
        """Set with loss_sums: the rest of every rank's logging window (its loss items, its task metric sums)."""
        self.restores = True
        """False while :meth:`kept`: a load leaves the loop and early stopping as they are."""

    def state_dict(self) -> dict[str, Any]:
        return {"loop": self.loop.state_dict(), "early_stopping": self.stopper.state_dict(),
                "loss_sums": self.loss_sums, "windows": self.windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.restores:
            return
        self.loop.load_state_dict(state["loop"])
        self.stopper.load_state_dict(state["early_stopping"])
        sums = state.get("loss_sums") or []
        if len(sums) == self.world_size:
            self.loop.loss_sum = sums[self.rank]
        elif sums:  # another world size: the logged loss of the first window is an approximation
            self.loop.loss_sum = sum(sums) / len(sums)
        windows = state.get("windows") or []  # none in a checkpoint from before: the main process's values
        if len(windows) == self.world_size:
            self.loop.loss_items = windows[self.rank]["loss_items"]
        metric_sums = restored([w["metric_sums"] for w in windows], self.rank, self.world_size)
        if metric_sums is not None:
            self.loop.metric_sums = metric_sums

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Loads inside leave this run's loop state and early stopping alone: the export reads an earlier
        checkpoint's weights after training, and the run's steps, stop reason and best must still say
        what happened."""
        self.restores = False
        try:
            yield
        finally:
            self.restores = True


class CheckpointPolicy:
    """The loop's CheckpointHook for a run folder; also resumes it."""

    def __init__(self, cfg: RunConfig, components: Components, state: LoopState, stopper: EarlyStopping,
                 run_dir: Path):
        self.cfg = cfg.checkpoint
        self.monitor, self.mode = cfg.early_stopping.monitor, cfg.early_stopping.mode.value
        self.c = components
        self.acc = components.accelerator
        self.state = state
        self.run_dir = run_dir
        self.root = checkpoints_dir(run_dir)
        self.config_hash = config_hash(cfg)
        self.stopper = stopper
        self.last_saved_step: int | None = None
        self.last_saved: str | None = None
        """The name of the checkpoint holding the state at ``last_saved_step``."""
        self.trainer_state = TrainerState(state, stopper, self.acc.process_index, self.acc.num_processes)
        self.acc.register_for_checkpointing(self.trainer_state)
        if components.weight_average is not None:
            self.acc.register_for_checkpointing(components.weight_average)
        self.best: BestWeights | None = None
        """Keeps the best evaluation's weights when they are exported (``checkpoint.export=best``)."""
        if (cfg.checkpoint.save_final_model or cfg.predicts_test) and cfg.checkpoint.resolved_export() is ExportChoice.best:
            total_steps = total_optimizer_steps(cfg, batches_per_pass(components.train_loader))
            self.best = BestWeights(components, self.root, cfg.checkpoint, stopper, total_steps, self._manifest_fields,
                                    on_complete=self.rotate)

    # -- CheckpointHook ------------------------------------------------------------------------------
    @property
    def saves_on_steps(self) -> bool:
        """Whether on_step_end may save (checkpoint.every_n_steps); the loop calls it only then."""
        return self.cfg.every_n_steps is not None

    def saves_at_step(self, step: int) -> bool:
        """Whether on_step_end saves after this optimizer step (checkpoint.every_n_steps)."""
        return self.cfg.every_n_steps is not None and step % self.cfg.every_n_steps == 0

    def on_step_end(self, state: LoopState, metrics: dict[str, float] | None) -> None:
        if self.saves_at_step(state.global_step):
            self.save(state)
        elif metrics is not None and self.best is not None:
            self.best.after_evaluation(state)

    def on_epoch_end(self, state: LoopState, metrics: dict[str, float] | None) -> None:
        if self.cfg.every_epoch:
            self.save(state)
        elif metrics is not None and self.best is not None:
            self.best.after_evaluation(state)

    def on_train_end(self, state: LoopState) -> None:
        """Always leave the final state (unless checkpoints are off): a max_steps end mid-epoch, an
        early stop between checkpoints or an interrupt all resume exactly from here. A stop signal
        (preemption, a time limit) saves even when checkpoints are off: its resume command must work.
        What follows (evaluation, export, an interrupted run's exit) finds every checkpoint complete."""
        if (self.cfg.enabled or state.stop_signal is not None) and self.last_saved_step != state.global_step:
            self.save(state)
        self.acc.wait_for_checkpoint()

    def save(self, state: LoopState) -> Path | None:
        """Write ``checkpoints/checkpoint_<N>`` (with async_save: in the background; the folder
        returned is complete once ``wait_for_checkpoint`` returns), then rotate (main process, after it
        is complete). Weights that are no longer finite are not saved (None): the newest checkpoint
        stays the last finite one, and rotation never removes it for a useless one."""
        if not weights_are_finite(self.c):
            log.warning("not saving a checkpoint at step %d: the weights are not finite", state.global_step)
            return None
        metrics = metrics_file(self.run_dir)
        metadata = {
            **self._manifest_fields(state),
            # What metrics.jsonl held at this point: a resumed run cuts it back to exactly this.
            "metrics_jsonl_bytes": metrics.stat().st_size if metrics.exists() else 0,
            # Whose kept weights a run resumed from here exports (app.engine.best_weights).
            BEST_STEP: self.stopper.best_step,
        }
        # Every rank's partial logging window, in one gather.
        windows = self.acc.gather_object((float(state.loss_sum), float(state.loss_items), as_floats(state.metric_sums)))
        self.trainer_state.loss_sums = [loss_sum for loss_sum, _, _ in windows]
        self.trainer_state.windows = [{"loss_items": items, "metric_sums": sums} for _, items, sums in windows]
        folder = self.acc.save_state(metadata=metadata, async_save=self.cfg.async_save, on_complete=self.rotate)
        self.last_saved_step, self.last_saved = state.global_step, folder.name
        return folder

    def _manifest_fields(self, state: LoopState) -> dict[str, Any]:
        """step, epoch, config hash and the monitored metric (when evaluated at this step) of a save."""
        metric = None
        if state.last_eval_step == state.global_step and self.monitor in state.last_metrics:
            metric = {"name": self.monitor, "value": float(state.last_metrics[self.monitor]), "mode": self.mode}
        return {"step": state.global_step, "epoch": state.epoch, "config_hash": self.config_hash, "metric": metric}

    def rotate(self, folder: Path) -> None:
        """Once ``folder`` (a checkpoint, or a best evaluation's kept weights) is complete (main process;
        with async_save on the writer thread): the checkpoints beyond total_limit go, never one holding
        needed best weights, then the kept weights no longer needed. The run's best is read as it is now:
        a newer best's save waits for this one, so none can be missed."""
        fault_point("before-rotate", folder.name.removeprefix(CHECKPOINT_PREFIX))
        needed = self.best.needed_steps(self.stopper.best_step) if self.best is not None else set()
        keep_weights = self.best.keep_from_checkpoint if self.best is not None else None
        for removed in rotate(self.root, self.cfg.total_limit, self.cfg.keep_best, newest=folder, keep_steps=needed,
                              keep_weights=keep_weights):
            log.debug("removed old checkpoint %s (checkpoint.total_limit=%s)", removed.relative_to(self.run_dir),
                      self.cfg.total_limit)
        if self.best is not None:  # asked again: a checkpoint just rotated away may have recorded an older best
            self.best.prune(self.best.needed_steps(self.stopper.best_step))

    # -- resume --------------------------------------------------------------------------------------
    def resume(self, resume: str | None) -> Manifest | None:
        """Restore the run from ``resume`` (None: start fresh). ``auto`` continues this run folder's
        newest valid checkpoint, or starts fresh when it has none yet. Returns the manifest used."""
        if resume is None:
            return None
        acc = self.acc
        if resume == "auto":
            found = bool(complete_checkpoints(self.root)) if acc.is_main_process else None
            if not acc.broadcast_object(found):
                log.info("resume=auto: no checkpoint in %s yet, starting a new run", self.root)
                return None
            source = self.run_dir
        else:
            source = Path(resume)
        manifest: Manifest = acc.load_state(source, config_hash=self.config_hash)
        log.info("resumed from %s (step %s, epoch %s)", manifest.folder, manifest.step, manifest.epoch)
        self.last_saved_step, self.last_saved = manifest.step, Path(manifest.folder).name
        # Resuming means going on: whatever stopped the saved run (max_steps, an interrupt, early
        # stopping) is decided again under this run's settings.
        self.state.stop_reason = None
        self.state.stop_signal = None
        # The loaders re-derived their position from samples consumed (the global batch may differ
        # from the checkpoint's); the loop counts in this run's batches.
        loader = self.c.train_loader
        self.state.batches_in_epoch = loader.position if loader.epoch == self.state.epoch else 0
        if acc.is_main_process:
            self._cut_metrics(manifest)
        return manifest

    def _cut_metrics(self, manifest: Manifest) -> None:
        """Drop what the interrupted run logged after the checkpoint, so no step appears twice."""
        path = metrics_file(self.run_dir)
        size = manifest.extra.get("metrics_jsonl_bytes")
        same_run = run_folder_of(Path(manifest.folder)).resolve() == self.run_dir.resolve()
        if same_run and isinstance(size, int) and path.exists() and path.stat().st_size > size:
            with open(path, "r+b") as f:
                f.truncate(size)
            log.info("cut %s back to step %d", path, manifest.step)


    # -- export --------------------------------------------------------------------------------------
    def weights_for_export(self, choice: ExportChoice) -> dict[str, Any]:
        """Put the weights to export into the model and describe them (``model/export.json``).

        ``best``: the final weights when the final evaluation is the best, else the weights of the best
        evaluation, from the folder holding them (``app.engine.best_weights``): the checkpoint of its
        step (its weights only: this run's loop state and early stopping stay as training left them) or
        ``checkpoints/best_<step>``. Only a run that cannot have kept them (a checkpoint written before
        they were kept, resumed) exports the final weights instead, and the metadata says so.
        ``checkpoint`` names the folder in ``checkpoints/`` holding the exported weights (absent when
        none does), ``metrics`` their evaluation."""
        state, monitor = self.state, self.monitor
        evaluated = state.last_eval_step == state.global_step
        final_metric = state.last_metrics.get(monitor) if evaluated else None
        described: dict[str, Any] = {
            "exported": "last", "step": state.global_step, "epoch": state.epoch, "final_step": state.global_step,
            "final_epoch": state.epoch,
            "metric": None if final_metric is None else {"name": monitor, "value": float(final_metric),
                                                          "mode": self.mode},
            "metrics": evaluation_metrics(state.last_metrics) if evaluated else {},
        }
        if self.last_saved_step == state.global_step and self.last_saved is not None:
            described["checkpoint"] = self.last_saved  # the final state's checkpoint holds these weights
        stopper = self.stopper
        best, best_step = stopper.best, stopper.best_step
        self.acc.wait_for_checkpoint()  # the best one may be the one still being written
        # The best is the first evaluation that reached it (EarlyStopping): a later tie is not exported.
        final_is_best = final_metric == best if best_step is None else best_step == state.global_step and evaluated
        if choice is ExportChoice.last or best is None or final_is_best:
            described["exported"] = "last" if choice is ExportChoice.last else "best"
            return described
        found: tuple[str, Manifest] | None = None
        if self.acc.is_main_process:
            held = holder(self.root, best, best_step, monitor)
            found = (str(held[0]), held[1]) if held is not None else None
        found = self.acc.broadcast_object(found)
        if found is None:
            log.warning("the weights of the best evaluation (step %s, %s = %s) are not kept in %s (a run resumed "
                        "from a checkpoint saved before they were): exporting the final weights", best_step, monitor,
                        human(best), self.root)
            described["exported"] = "last (best not saved)"
            return described
        chosen, manifest = found
        log.info("exporting the best evaluation: step %d, %s = %s (loading %s)", manifest.step, monitor, human(best),
                 Path(chosen).relative_to(self.run_dir))
        if holds_weights_only(manifest):
            load_kept(self.c, Path(chosen))
        else:
            with self.trainer_state.kept():
                self.acc.load_state(chosen)
        return {**described, "exported": "best", "step": manifest.step, "epoch": manifest.epoch,
                "checkpoint": Path(chosen).name, "metric": manifest.metric,
                "metrics": evaluation_metrics(self.stopper.best_metrics)}


def evaluation_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """An evaluation's metrics as logged, without the epoch the loop adds to them."""
    return {key: value for key, value in metrics.items() if key != "epoch"}


def tracker_kwargs(manifest: Manifest | None, group: str | None = None) -> dict[str, Any]:
    """Tracker options: a resumed run's TensorBoard hides the interrupted run's later events; wandb
    puts the run in ``group`` (a sweep's jobs share one)."""
    kwargs: dict[str, Any] = {"tensorboard": {"purge_step": manifest.step + 1}} if manifest is not None else {}
    if group is not None:
        kwargs["wandb"] = {"group": group}
    return kwargs


def export_model(c: Components, folder: Path, metadata: dict[str, Any] | None = None,
                 adapter: AdapterConfig | None = None, card: str | None = None) -> None:
    """Write the final model to ``folder`` atomically: weights (``model.safetensors`` or shards, with
    the unwrapped model's key names; the weight average with trainer.ema_decay) and the task's
    artifacts, in a temporary folder renamed into place. Every process calls it (FSDP2 gathers the
    weights). With LoRA adapters (``adapter``): peft's ``adapter/`` and, with merge_on_export, the
    merged weights (``app.engine.adapters.export_adapter``). ``card``: the model card, ``README.md``."""
    acc = c.accelerator
    temporary = temporary_sibling(folder)
    if acc.is_main_process:
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    artifacts_model = acc.unwrap_model(c.model)
    with c.evaluation_weights():
        # Every process gathers (FSDP2); the tensors may be the live parameters, so they are written
        # before the training weights come back. Written plainly: the folder is published whole, below.
        if isinstance(adapter, LoraAdapterConfig):
            state = acc.get_state_dict(c.model)
            if acc.is_main_process:
                temporary.mkdir(parents=True)
                artifacts_model = export_adapter(c.task, adapter, state, temporary)
        else:
            shards = acc.model_shards(c.model, temporary)
            if acc.is_main_process:
                temporary.mkdir(parents=True)
                write_weights(temporary, shards, safe=True, each_file_atomic=False)
    if acc.is_main_process:
        c.task.save_artifacts(artifacts_model, temporary)
        if metadata is not None:
            (temporary / EXPORT_FILE).write_text(json.dumps(metadata, indent=1) + "\n", encoding="utf-8")
        if card is not None:
            (temporary / MODEL_CARD_FILE).write_text(card, encoding="utf-8")
        fsync_paths(p for p in temporary.rglob("*") if p.is_file())
        publish(temporary, folder)
        if metadata is not None:
            metric = metadata.get("metric") or {}
            log.info("exported the %s weights (step %s%s) to %s", metadata["exported"], metadata["step"],
                     f", {metric['name']} = {human(metric['value'])}" if metric else "", folder)
        else:
            log.info("exported the model to %s", folder)
    acc.wait_for_everyone()
