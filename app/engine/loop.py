"""The one training loop. It reads top to bottom: epochs, micro-batches, accumulation, clipping,
optimizer and scheduler steps, periodic evaluation, early stopping, logging and checkpoints.

Everything device- or process-specific goes through the Accelerator; this file never names a
device type or a collective backend.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from app.config import RunConfig
from app.distributed import Accelerator
from app.engine.faults import fault_point
from app.engine.progress import Progress, human, human_metrics, with_progress
from app.engine.triggers import EarlyStopping
from app.engine.weight_average import WeightAverage
from app.interrupts import StopSignals, signal_name
from app.tasks.base import Task

log = logging.getLogger(__name__)

NON_FINITE_LOSS = "training loss is"
"""How a stop reason for a NaN/infinite loss begins (a run that ends so is no result for a sweep)."""


@dataclass
class LoopState:
    """Where the loop is; saved with every checkpoint so a resumed run continues exactly."""

    global_step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    batches_in_epoch: int = 0
    """Micro-batches of the current epoch this process has consumed."""
    stop_reason: str | None = None
    last_eval_step: int = -1
    last_metrics: dict[str, float] = field(default_factory=dict)
    loss_sum: float | torch.Tensor = 0.0
    """Training loss summed since the last log line: a device tensor while training (no host sync per
    step), a float in a checkpoint, so the first loss logged after a resume is the uninterrupted one."""
    loss_batches: int = 0
    """Micro-batches summed in loss_sum."""
    non_finite_loss_step: int | None = None
    """The optimizer step at which the logged training loss was NaN or infinite, if it was."""
    stop_signal: int | None = None
    """The signal (SIGINT, SIGTERM) that stopped training, agreed by every process."""

    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self), "loss_sum": float(self.loss_sum)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class CheckpointHook(Protocol):
    """What the loop asks of a checkpoint policy (``app.engine.checkpoint``); the default does nothing."""

    def on_step_end(self, state: LoopState, metrics: dict[str, float] | None) -> None: ...

    def on_epoch_end(self, state: LoopState, metrics: dict[str, float] | None) -> None: ...

    def on_train_end(self, state: LoopState) -> None: ...


class NoCheckpoints:
    def on_step_end(self, state: LoopState, metrics: dict[str, float] | None) -> None:
        pass

    def on_epoch_end(self, state: LoopState, metrics: dict[str, float] | None) -> None:
        pass

    def on_train_end(self, state: LoopState) -> None:
        pass


@dataclass
class Components:
    """The prepared objects the loop works on (built by ``app.engine.build``)."""

    accelerator: Accelerator
    task: Task
    model: nn.Module
    optimizer: Any
    scheduler: Any
    train_loader: Any
    eval_loader: Any
    weight_average: WeightAverage | None = None
    """trainer.ema_decay: evaluation and export use these averaged weights."""
    show_progress: bool = False
    """Progress bars (training and evaluation): logging.progress_bar, on the main process only."""
    profiler: Any = None
    """A ``torch.profiler.profile`` stepped after every optimizer step (trainer.profile_steps)."""
    extra_eval_loaders: dict[str, Any] = field(default_factory=dict)
    """Further evaluation sets by name (``TaskData.extra_eval``): evaluated after ``eval_loader``, their
    metrics reported as ``eval/<metric>_<name>`` (GLUE MNLI: ``mm``, ``eval/accuracy_mm``)."""

    def evaluation_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights to evaluate and export: the average when there is one, else the model's own."""
        return self.weight_average.applied() if self.weight_average is not None else contextlib.nullcontext()


def steps_per_epoch(num_batches: int, accumulation: int) -> int:
    """Optimizer steps in one epoch: the last, shorter accumulation window also steps."""
    return math.ceil(num_batches / accumulation)


def total_optimizer_steps(cfg: RunConfig, num_batches: int) -> int:
    per_epoch = steps_per_epoch(num_batches, cfg.trainer.gradient_accumulation_steps)
    by_epochs = per_epoch * cfg.trainer.max_epochs if cfg.trainer.max_epochs > 0 else None
    by_steps = cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else None
    return min(s for s in (by_epochs, by_steps) if s is not None)


@torch.no_grad()
def evaluate(c: Components) -> dict[str, float]:
    """Metrics over the whole evaluation set (and each further one, its keys suffixed with its name),
    from predictions gathered across processes with the padding duplicates removed.

    Only the main process keeps the gathered predictions and computes the metrics, which it then
    shares with the others: the evaluation set's logits are held once, not once per process (the
    other processes drop each batch's gathered copy at once)."""
    acc = c.accelerator
    c.model.eval()
    metrics: dict[str, float] = {}
    with c.evaluation_weights():
        for suffix, loader in (("", c.eval_loader), *((f"_{n}", d) for n, d in c.extra_eval_loaders.items())):
            metrics.update({f"eval/{k}{suffix}": v for k, v in evaluate_set(c, loader, suffix).items()})
    c.model.train()
    return acc.backend.broadcast_object(metrics if acc.is_main_process else None, src=0)


def evaluate_set(c: Components, loader: Any, suffix: str) -> dict[str, float]:
    """One evaluation set's metrics (keys without prefix) on the main process; {} on the others."""
    acc = c.accelerator
    keep = acc.is_main_process
    logits, labels = [], []
    gathered_samples = 0
    for batch in with_progress(loader, c.show_progress, desc="eval" + suffix.replace("_", " ")):
        out = c.task.step(c.model, batch)
        batch_logits, batch_labels = acc.gather_for_metrics((out.logits.float(), out.labels))
        gathered_samples += len(batch_labels)
        if keep:
            logits.append(batch_logits.cpu())
            labels.append(batch_labels.cpu())
    expected = loader.total_dataset_length
    if gathered_samples != expected:
        raise RuntimeError(f"evaluation gathered {gathered_samples} predictions for {expected} samples.")
    if not keep:
        return {}
    metrics = c.task.compute_metrics(torch.cat(logits), torch.cat(labels))
    return {**metrics, "num_samples": gathered_samples}


def fit(c: Components, cfg: RunConfig, state: LoopState, stopper: EarlyStopping,
        checkpoints: CheckpointHook | None = None, interrupts: StopSignals | None = None) -> LoopState:
    """Train until max_epochs/max_steps, until a stop trigger fires on any process, or until a stop
    signal (``interrupts``) arrives: then every process stops after the same optimizer step, and
    ``state.stop_signal`` says which signal."""
    acc = c.accelerator
    checkpoints = checkpoints or NoCheckpoints()
    total_steps = total_optimizer_steps(cfg, len(c.train_loader))
    progress = Progress(total_steps, initial=state.global_step, enabled=c.show_progress)
    try:
        train(c, cfg, state, stopper, checkpoints, interrupts, progress, total_steps)
        # Every process learns whether any was signalled (one all-reduce per run).
        signalled = interrupts.received if interrupts is not None else None
        agreed = int(acc.backend.all_reduce(torch.tensor([float(signalled or 0)]).to(acc.device), "max").item())
        if agreed:
            state.stop_signal = agreed
            state.stop_reason = f"interrupted by {signal_name(agreed)} at step {state.global_step}"
    finally:
        progress.close(state.stop_reason)
    # The final state, so that a resumed run (or one with trainer.max_steps raised) continues exactly
    # where this one ended; saved before the final evaluation, which draws from the random streams.
    checkpoints.on_train_end(state)
    if state.stop_signal is None and state.last_eval_step != state.global_step:
        # The run ended between evaluations: measure the final weights too.
        run_evaluation(c, state, stopper, may_stop=False)
    return state


def train(c: Components, cfg: RunConfig, state: LoopState, stopper: EarlyStopping, checkpoints: CheckpointHook,
          interrupts: StopSignals | None, progress: Progress, total_steps: int) -> None:
    acc, model, optimizer, scheduler = c.accelerator, c.model, c.optimizer, c.scheduler
    t = cfg.trainer
    eval_every, log_every, max_grad_norm = t.eval_every_n_steps, t.log_every_n_steps, t.max_grad_norm
    global_batch = c.train_loader.batch_size * acc.num_processes
    several_processes = acc.num_processes > 1
    # A signal may reach one process only: on several, they agree after every step, one step late (an
    # asynchronous host all-reduce, read at the next step: no wait, no device sync).
    signals_seen = acc.backend.step_flag() if interrupts is not None and several_processes else None
    batches_per_epoch = len(c.train_loader)
    # The state holds this very tensor (updated in place) so a checkpoint carries the partial window.
    running_loss = state.loss_sum = torch.tensor(float(state.loss_sum), device=acc.device)
    window_start = time.perf_counter()
    window_samples = 0
    inject_fault = fault_point(acc.process_index)  # drills only: see app/engine/faults.py
    # Built once: model.parameters() walks every module, a few per cent of a small model's step.
    # Parameters keep their identity during training (FSDP2 shards them when the model is prepared;
    # checkpoints and weight averages copy into them).
    parameters = list(model.parameters())
    model.train()

    # max_epochs <= 0 leaves the end to max_steps (the config refuses runs with neither).
    while ((t.max_epochs <= 0 or state.epoch < t.max_epochs) and state.global_step < total_steps
           and state.stop_reason is None):
        c.train_loader.set_epoch(state.epoch)
        loader = c.train_loader
        if state.batches_in_epoch:
            loader = acc.skip_first_batches(c.train_loader, state.batches_in_epoch)
        for batch in loader:
            with acc.accumulate(model):
                sync = acc.sync_gradients  # decided for this micro-batch by accumulate
                out = c.task.step(model, batch)
                acc.backward(out.loss)
                if sync and max_grad_norm is not None:
                    acc.clip_grad_norm_(parameters, max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            state.batches_in_epoch += 1
            window_samples += global_batch
            # Accumulated on the device: no host sync per step.
            running_loss += out.loss.detach()
            state.loss_batches += 1
            if not sync:
                continue

            state.global_step += 1
            if c.weight_average is not None:
                c.weight_average.update()
            if inject_fault is not None:
                inject_fault(state.global_step)
            progress.update()
            if c.profiler is not None:
                c.profiler.step()
            decision_point = False
            metrics: dict[str, float] | None = None

            if state.global_step % log_every == 0:
                decision_point = True
                # Divided on the host, and reduced only when there is more than one process: this step
                # runs with cold caches, where each tensor op and call costs several times its warm price.
                summed = acc.reduce(running_loss, reduction="mean") if several_processes else running_loss
                loss = summed.item() / state.loss_batches
                elapsed = time.perf_counter() - window_start
                train_metrics = {
                    "train/loss": loss,
                    # The highest group rate: optim.lr's schedule (with optim.layer_decay, the head's).
                    "train/lr": max(scheduler.get_last_lr()),
                    "train/samples_per_s": window_samples / max(elapsed, 1e-9),
                    "epoch": state.epoch,
                }
                acc.log(train_metrics, step=state.global_step)
                progress.show(loss=loss, samples_per_s=train_metrics["train/samples_per_s"])
                running_loss.zero_()
                state.loss_batches = 0
                window_start, window_samples = time.perf_counter(), 0
                if not math.isfinite(loss) and state.non_finite_loss_step is None:
                    state.non_finite_loss_step = state.global_step
                if cfg.early_stopping.stop_on_nan and not math.isfinite(loss):
                    state.stop_reason = f"{NON_FINITE_LOSS} {loss} at step {state.global_step}"
                    acc.set_trigger()

            if eval_every is not None and state.global_step % eval_every == 0:
                decision_point = True
                metrics = run_evaluation(c, state, stopper)

            checkpoints.on_step_end(state, metrics)

            if signals_seen is not None:
                if signals_seen.post(interrupts is not None and interrupts.received is not None):
                    state.stop_reason = state.stop_reason or "interrupted"
                    break
            elif interrupts is not None and interrupts.received is not None and state.stop_reason is None:
                state.stop_reason = "interrupted"
                break
            if decision_point and acc.check_trigger():
                state.stop_reason = state.stop_reason or "stop requested by another process"
                break
            if state.global_step >= total_steps:
                break

        if state.batches_in_epoch >= batches_per_epoch:
            state.epoch += 1
            state.batches_in_epoch = 0
            if state.stop_reason is None:
                metrics = run_evaluation(c, state, stopper) if eval_every is None else None
                checkpoints.on_epoch_end(state, metrics)
                if metrics is not None and acc.check_trigger():
                    state.stop_reason = state.stop_reason or "stop requested by another process"
        if state.stop_reason is None and state.global_step >= total_steps:
            state.stop_reason = f"reached {total_steps} optimizer steps"

    if signals_seen is not None:
        signals_seen.close()  # the last step's flag (a signal then is read by fit's final agreement)
    if state.stop_reason is None:
        state.stop_reason = (f"reached {total_steps} optimizer steps" if state.global_step >= total_steps
                             else f"reached {t.max_epochs} epochs")


def run_evaluation(c: Components, state: LoopState, stopper: EarlyStopping,
                   may_stop: bool = True) -> dict[str, float]:
    acc = c.accelerator
    metrics = evaluate(c)
    metrics["epoch"] = state.epoch
    state.last_metrics = metrics
    state.last_eval_step = state.global_step
    acc.log(metrics, step=state.global_step)
    log.info("step %d: %s", state.global_step, human_metrics(metrics, prefix="eval/"))
    if stopper.update(metrics) and may_stop:
        state.stop_reason = (f"{stopper.monitor} did not improve for {stopper.bad_evaluations} evaluations "
                             f"(best {human(stopper.best)})")
        acc.set_trigger()
    return metrics
