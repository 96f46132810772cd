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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from app.config import RunConfig
from app.distributed import Accelerator
from app.distributed.host_reads import HostRead
from app.distributed.step_flags import StepFlag
from app.engine.budget import Budget, Limit, epochs, training_budget
from app.engine.faults import fault_point
from app.engine.progress import Progress, human, human_metrics, with_progress
from app.engine.pruning import NoPruning, Pruning
from app.engine.samples import write_samples
from app.engine.stop_reason import StopReason
from app.engine.task_hooks import after_step_hook, with_step_totals
from app.engine.threads import ThreadChoice
from app.engine.throughput import Throughput
from app.engine.triggers import EarlyStopping
from app.engine.weight_average import WeightAverage
from app.engine.window_metrics import MetricSums, add_step_metrics, as_floats, logged, on_device, reduced
from app.interrupts import StopSignals, signal_name
from app.tasks.base import StepOutput, SummedMetrics, Task, WritesSamples, samples_in

log = logging.getLogger(__name__)

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
    """Training loss summed since the last log line (over items, or micro-batch means for a task that
    gives a mean: see ``summed_loss``): a device tensor while training (no host sync per step), a float
    in a checkpoint, so the first loss logged after a resume is the uninterrupted one."""
    loss_items: float | torch.Tensor = 0.0
    """The items (or micro-batches) summed in loss_sum, this process's; kept like loss_sum."""
    loss_batches: int = 0
    """Micro-batches summed in loss_sum."""
    metric_sums: MetricSums = field(default_factory=dict)
    """The task's own training metrics (``StepOutput.sample_metrics``) summed over the same window, by
    name; kept like loss_sum (``app/engine/window_metrics.py``)."""
    non_finite_loss_step: int | None = None
    """The optimizer step at which the logged training loss was NaN or infinite, if it was."""
    stop_signal: int | None = None
    """The signal (SIGINT, SIGTERM) that stopped training, agreed by every process."""

    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self), "loss_sum": float(self.loss_sum), "loss_items": float(self.loss_items),
                "metric_sums": as_floats(self.metric_sums)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "loss_items" not in state:  # a checkpoint from before item-weighted losses: micro-batch means
            state = {**state, "loss_items": float(state.get("loss_batches", 0))}
        for key, value in state.items():
            setattr(self, key, value)


class LogWindow(NamedTuple):
    """A logging window closed at a log step, its summed loss (and tokens) being read on the host."""

    step: int
    reading: HostRead
    """The loss summed over the window and the items (or micro-batches) it sums, then the task's metric
    sums, on all processes, then the tokens drawn in it where the task counts them (``read_async``)."""
    batches: int
    """Micro-batches this run trained in the window: its throughput."""
    seconds: float
    epoch: int
    lr: float
    metric_names: tuple[str, ...]
    """The task's training metrics whose sums ``reading`` holds after the loss's two."""


class CheckpointHook(Protocol):
    """What the loop asks of a checkpoint policy (``app.engine.checkpoint``); the default does nothing.
    A hook whose ``on_step_end`` saves at no step without an evaluation may say so with a false
    ``saves_on_steps``: the loop then spares that call after every optimizer step. A hook may also say
    at which steps ``on_step_end`` saves (``saves_at_step(step) -> bool``): where reads lag, the loop
    writes a log line it left for later before such a save, so that the checkpoint's ``metrics.jsonl``
    holds its step's line; a hook that does not say is taken to save at every step."""

    def on_step_end(self, state: LoopState, metrics: dict[str, float] | None) -> None: ...

    def on_epoch_end(self, state: LoopState, metrics: dict[str, float] | None) -> None: ...

    def on_train_end(self, state: LoopState) -> None: ...


class NoCheckpoints:
    def on_step_end(self, state: LoopState, metrics: dict[str, float] | None) -> None:
        pass

    def saves_at_step(self, step: int) -> bool:
        return False

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
    pruning: Pruning = field(default_factory=NoPruning)
    """A pruned sweep's trial reports each evaluation to its study (``app.engine.pruning``)."""
    extra_eval_loaders: dict[str, Any] = field(default_factory=dict)
    """Further evaluation sets by name (``TaskData.extra_eval``): evaluated after ``eval_loader``, their
    metrics reported as ``eval/<metric>_<name>`` (GLUE MNLI: ``mm``, ``eval/accuracy_mm``)."""
    threads: ThreadChoice | None = None
    """torch's intra-op threads in this process and why (``app.engine.threads``), for the model summary."""
    throughput: Throughput | None = None
    """The training throughput (``app.engine.throughput``), made by the first ``fit``; its means end the run's log."""

    def evaluation_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights to evaluate and export: the average when there is one, else the model's own."""
        return self.weight_average.applied() if self.weight_average is not None else contextlib.nullcontext()


def summed_loss(acc: Accelerator, out: StepOutput) -> tuple[torch.Tensor, torch.Tensor | int | None]:
    """A micro-batch's loss as training uses it: the sum over its real samples' items and their number
    (the duplicates that complete an epoch's last global batch left out), which ``Accelerator.backward``
    normalises by the items of the whole optimizer step; or, from a task that gives only a mean, that
    mean and None (micro-batches weigh alike)."""
    if out.sample_losses is None:
        assert out.loss is not None  # StepOutput takes one of the two
        return out.loss, None
    losses = acc.local_for_metrics(out.sample_losses)
    items = out.sample_items
    if isinstance(items, torch.Tensor):
        return losses.sum(), acc.local_for_metrics(items).sum()
    assert items is not None
    return losses.sum(), items * losses.shape[0]


def batches_per_pass(loader: Any) -> int | None:
    """A prepared loader's batches per epoch; None for a stream, whose pass ends when its data does."""
    try:
        return len(loader)
    except TypeError:
        return None


def total_optimizer_steps(cfg: RunConfig, num_batches: int | None) -> int:
    """The run's optimizer steps: max_steps, or max_epochs' worth of batches if fewer (``num_batches``
    None: a stream's, unknown: max_steps, which the config then requires); ``app.engine.budget``."""
    return training_budget(cfg.trainer, num_batches).total_steps


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
    return acc.broadcast_object(metrics if acc.is_main_process else None)


def evaluate_set(c: Components, loader: Any, suffix: str) -> dict[str, float]:
    """One evaluation set's metrics (keys without prefix) on the main process; {} on the others."""
    if isinstance(c.task, SummedMetrics):
        return evaluate_sums(c, c.task, loader, suffix)
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
    return {**metrics, "num_samples": samples_in(getattr(loader, "dataset", None), gathered_samples)}


def evaluate_sums(c: Components, task: SummedMetrics, loader: Any, suffix: str) -> dict[str, float]:
    """An evaluation set's metrics from the sums of the task's per-sample quantities: summed on each
    process's device (the duplicates completing the last global batch left out), then reduced across
    processes once; no per-sample output is gathered. The same metrics on every process."""
    acc = c.accelerator
    sums: dict[str, torch.Tensor] = {}
    samples = 0
    for batch in with_progress(loader, c.show_progress, desc="eval" + suffix.replace("_", " ")):
        rows = acc.local_for_metrics(task.evaluation_sums(c.model, batch))
        samples += len(next(iter(rows.values())))
        for key, values in rows.items():
            sums[key] = sums[key] + values.sum() if key in sums else values.sum()
    totals = acc.reduce({**sums, "num_samples": torch.tensor(samples, device=acc.device)}, reduction="sum")
    reduced = {key: value.item() for key, value in totals.items()}  # one host read per sum, per evaluation
    counted, expected = int(reduced.pop("num_samples")), loader.total_dataset_length
    if counted != expected:
        raise RuntimeError(f"evaluation summed {counted} samples for {expected}.")
    return {**task.metrics_from_sums(reduced), "num_samples": samples_in(getattr(loader, "dataset", None), counted)}


def fit(c: Components, cfg: RunConfig, state: LoopState, stopper: EarlyStopping,
        checkpoints: CheckpointHook | None = None, interrupts: StopSignals | None = None) -> LoopState:
    """Train until max_epochs/max_steps, until a stop trigger fires on any process, or until a stop
    signal (``interrupts``) arrives: then every process stops after the same optimizer step, and
    ``state.stop_signal`` says which signal."""
    acc = c.accelerator
    checkpoints = checkpoints or NoCheckpoints()
    budget = training_budget(cfg.trainer, batches_per_pass(c.train_loader))
    if (plan := budget.start_sentence()) is not None:
        log.info("%s", plan)
    progress = Progress(budget.total_steps, initial=state.global_step, enabled=c.show_progress)
    try:
        train(Training(c, cfg, state, stopper, checkpoints, interrupts, progress, budget))
        # Every process learns whether any was signalled (one all-reduce per run).
        signalled = interrupts.received if interrupts is not None else None
        agreed = int(acc.reduce(torch.tensor([float(signalled or 0)], device=acc.device), reduction="max").item())
        if agreed:
            state.stop_signal = agreed
            state.stop_reason = StopReason.signalled.sentence(signal=signal_name(agreed), step=state.global_step)
    finally:
        progress.close(state.stop_reason)
    # The final state, so that a resumed run (or one with trainer.max_steps raised) continues exactly
    # where this one ended; saved before the final evaluation, which draws from the random streams.
    checkpoints.on_train_end(state)
    if state.stop_signal is None and state.last_eval_step != state.global_step:
        # The run ended between evaluations: measure the final weights too (training is over: no stop).
        run_evaluation(c, state, stopper)
    return state


def train(run: Training) -> None:
    """Epochs of micro-batches until a stop is decided. After every optimizer step, its bookkeeping
    (:meth:`Training.on_optimizer_step`: logging, evaluation, checkpoints) and the one decision whether
    every process stops there (:meth:`Training.should_stop`)."""
    c, state = run.c, run.state
    acc, model, optimizer, scheduler, task = c.accelerator, c.model, c.optimizer, c.scheduler, c.task
    max_grad_norm = run.max_grad_norm
    # Built once: model.parameters() walks every module, a few per cent of a small model's step.
    # Parameters keep their identity during training (FSDP2 shards them when the model is prepared;
    # checkpoints and weight averages copy into them).
    parameters = list(model.parameters())
    model.train()
    run.check_budget()
    while run.stop is None:
        for batch in run.epoch_batches():
            with acc.accumulate(model):
                sync = acc.sync_gradients  # decided for this micro-batch by accumulate
                out = task.step(model, batch)
                loss, items = summed_loss(acc, out)
                # The step's gradient: the mean over all its items, across micro-batches and processes.
                acc.backward(loss, num_items=items)
                # Summed on the device (no host sync per step), before the optimizer step: on a lazy
                # device the sums are then part of the step's graph, which a log step reads a step later.
                state.loss_sum += loss.detach()
                state.loss_items += 1 if items is None else items
                add_step_metrics(acc, state.metric_sums, out)
                if sync and max_grad_norm is not None:
                    acc.clip_grad_norm_(parameters, max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            state.batches_in_epoch += 1
            state.loss_batches += 1
            if sync and run.should_stop(run.after_optimizer_step()):
                break
        run.on_epoch_end()
    run.close()


class Training:
    """One ``train()``: what it keeps beside the LoopState (settings, the logging window, the per-step
    hooks in use, how a signal is seen) and its decisions: what an optimizer step records
    (:meth:`on_optimizer_step`), whether to stop after it (:meth:`should_stop`), what an epoch's end
    does (:meth:`on_epoch_end`) and when the step and epoch budget is spent (:meth:`check_budget`)."""

    def __init__(self, c: Components, cfg: RunConfig, state: LoopState, stopper: EarlyStopping,
                 checkpoints: CheckpointHook, interrupts: StopSignals | None, progress: Progress, budget: Budget):
        acc, t = c.accelerator, cfg.trainer
        self.c, self.acc, self.state, self.stopper, self.checkpoints = c, acc, state, stopper, checkpoints
        self.progress, self.budget, self.total_steps = progress, budget, budget.total_steps
        self.log_every, self.eval_every, self.max_grad_norm = t.log_every_n_steps, t.eval_every_n_steps, t.max_grad_norm
        self.stop_on_nan = cfg.early_stopping.stop_on_nan
        self.several_processes = acc.num_processes > 1
        if c.throughput is None:
            peak = cfg.hardware.peak_tflops * 1e12 if cfg.hardware.peak_tflops is not None else acc.peak_flops()
            c.throughput = Throughput(acc, c.task, c.model, c.train_loader.batch_size * acc.num_processes, peak)
        self.throughput = c.throughput
        self.batches_per_epoch = batches_per_pass(c.train_loader)
        """None for a stream: its loader says when its pass is over (``pass_finished``)."""
        self.stop: StopReason | None = None
        """The decision, once taken (``state.stop_reason`` holds its sentence)."""
        # A signal may reach one process only: on several, they agree after every step, one step late (an
        # asynchronous host all-reduce, read at the next step: no wait, no device sync).
        self.signals = acc.step_flag() if interrupts is not None and self.several_processes else None
        self.signal_seen = _signal_check(interrupts, self.signals)
        self.interrupts = interrupts
        # The checkpoint hook after a step without evaluation only where it may save there: not for
        # NoCheckpoints' no-op, nor for a hook that says it saves at no step (saves_on_steps).
        self.checkpoint_steps = (type(checkpoints).on_step_end is not NoCheckpoints.on_step_end
                                 and bool(getattr(checkpoints, "saves_on_steps", True)))
        self.saves_at_step: Callable[[int], bool] = getattr(checkpoints, "saves_at_step", lambda step: True)
        # On the device while training (a checkpoint reads the partial window from the state).
        state.loss_sum = torch.tensor(float(state.loss_sum), device=acc.device)
        state.loss_items = torch.tensor(float(state.loss_items), device=acc.device)
        state.metric_sums = {**on_device(state.metric_sums, acc.device)}
        # The logging window: since when, and from which of state.loss_batches (a resumed window began
        # before this run).
        self.window_start, self.window_first_batch = time.perf_counter(), state.loss_batches
        self.step_hooks = self._step_hooks()
        # Where reading the device at once would stall it (acc.reads_lag: the device runs ahead of the
        # host), a log step's values are read one optimizer step later: its line waits in late_log until
        # then (or an evaluation, or the end).
        self.late_log: LogWindow | None = None
        self.after_optimizer_step = self.on_optimizer_step_reading_late if acc.reads_lag else self.on_optimizer_step
        """What ``train()`` calls after every optimizer step; returns whether the step is a decision point."""

    def _step_hooks(self) -> tuple[Callable[[], object], ...]:
        """What runs after every optimizer step, in this order; only those in use (nothing is called
        for a feature that is off)."""
        c, state = self.c, self.state
        inject_fault = fault_point(self.acc.process_index, self.interrupts)  # drills only: see app/engine/faults.py
        hooks = (after_step_hook(c.task, c.model, state),  # the task's own update (TR-DPO's reference), first
                 c.weight_average.update if c.weight_average is not None else None,
                 (lambda: inject_fault(state.global_step)) if inject_fault is not None else None,
                 self.progress.update if self.progress.counts else None,
                 c.profiler.step if c.profiler is not None else None)
        return tuple(hook for hook in hooks if hook is not None)

    def epoch_batches(self) -> Any:
        """The training loader at the state's epoch, from where a resumed epoch left off (tokens counted
        as drawn, for a task that counts them; a step's batches drawn together, for one that reads its totals)."""
        loader, state = self.c.train_loader, self.state
        loader.set_epoch(state.epoch)
        batches = self.acc.skip_first_batches(loader, state.batches_in_epoch) if state.batches_in_epoch else loader
        batches = batches if self.throughput.count_tokens is None else self.throughput.counted(batches)
        return with_step_totals(batches, self.acc, self.c.task, self.c.model)  # as they are unless the task reads them

    def on_optimizer_step(self) -> bool:
        """Count the step, run the per-step hooks, log the training loss every log_every_n_steps,
        evaluate every eval_every_n_steps, then the checkpoint policy's turn. Returns whether the step
        logged or evaluated: only then may a stop trigger have been raised (a decision point)."""
        state = self.state
        state.global_step += 1
        for hook in self.step_hooks:
            hook()
        logged = state.global_step % self.log_every == 0
        if logged:
            self.log_training_loss(state.global_step)
        elif state.global_step >= self.total_steps:
            self.log_unfinished_window()  # the run's last line: before its step's evaluation
        if self.eval_every is not None and state.global_step % self.eval_every == 0:
            self.checkpoints.on_step_end(state, self.evaluate())
            return True
        if self.checkpoint_steps:
            if self.late_log is not None and self.saves_at_step(state.global_step):
                self.write_late_log()  # before its step's checkpoint (which waits for the device anyway)
            self.checkpoints.on_step_end(state, None)
        return logged

    def on_optimizer_step_reading_late(self) -> bool:
        """:meth:`on_optimizer_step` where reads lag: first the previous log step's line, whose values
        are in by now; a step that writes one is a decision point (its loss may stop training)."""
        late = self.write_late_log()
        return self.on_optimizer_step() or late

    def should_stop(self, decision_point: bool) -> bool:
        """Whether every process stops after this optimizer step: a signal (seen by any process), a
        stop trigger raised at a decision point by any process (early stopping, a non-finite loss; one
        all-reduce), or max_steps (whose reason the epoch's end gives, after its evaluation). A reason
        already decided is kept."""
        if self.signal_seen is not None and self.signal_seen():
            self.stop_unless_decided(StopReason.interrupted)
            return True
        if decision_point and self.acc.check_trigger():
            self.stop_unless_decided(StopReason.another_process)
            return True
        return self.state.global_step >= self.total_steps

    def on_epoch_end(self) -> None:
        """After an epoch's batches, or a stop inside it: a completed epoch is counted and, unless
        training stops, evaluated (with evaluations per epoch) and offered to the checkpoint policy;
        then the budget."""
        state = self.state
        if self.epoch_consumed():
            if self.stop is None and self.budget_spent(epochs=state.epoch + 1):
                self.log_unfinished_window()  # the run's last line: before the epoch's evaluation, in its epoch
            state.epoch += 1
            state.batches_in_epoch = 0
            if self.stop is None:
                metrics = self.evaluate() if self.eval_every is None else None
                if metrics is None:
                    self.write_late_log()  # before the epoch's checkpoint, as an evaluation writes it
                self.checkpoints.on_epoch_end(state, metrics)
                if metrics is not None and self.acc.check_trigger():
                    self.stop_unless_decided(StopReason.another_process)
        self.check_budget()

    def epoch_consumed(self) -> bool:
        """Whether the epoch's last batch has been trained on (a stop inside it leaves it unfinished)."""
        if self.batches_per_epoch is None:
            return bool(self.c.train_loader.pass_finished)
        return self.state.batches_in_epoch >= self.batches_per_epoch

    def budget_spent(self, epochs: int) -> bool:
        """Whether trainer.max_steps or trainer.max_epochs is used up after ``epochs`` whole epochs."""
        return self.budget.reached(self.state.global_step, epochs) is not None

    def check_budget(self) -> None:
        """Stop when the limit that ends the run (``app.engine.budget``: trainer.max_steps or
        trainer.max_epochs, the first reached) is used up; the stop sentence names it."""
        if self.stop is not None:
            return
        reached = self.budget.reached(self.state.global_step, self.state.epoch)
        if reached is Limit.max_steps:
            self.stop_for(StopReason.max_steps, total_steps=self.total_steps)
        elif reached is Limit.max_epochs:
            self.stop_for(StopReason.max_epochs, epochs=epochs(self.budget.max_epochs),
                          total_steps=self.state.global_step)

    def log_training_loss(self, step: int, keep_window: bool = False) -> None:
        """Close the logging window: start reading its summed loss (and tokens) on the host, and write
        its line now, or one step later where reads lag (:attr:`late_log`). ``keep_window``: see
        :meth:`log_unfinished_window`."""
        acc, state = self.acc, self.state
        loss_sum, loss_items = state.loss_sum, state.loss_items
        assert isinstance(loss_sum, torch.Tensor) and isinstance(loss_items, torch.Tensor)  # see __init__
        # Reduced only when there is more than one process (the task's metric sums stacked with the
        # loss's: one collective), and divided on the host: this step runs with cold caches, where each
        # tensor op and call costs several times its warm price.
        metric_sums = on_device(state.metric_sums, acc.device)  # there already: for the type checker
        names, window_sums = tuple(metric_sums), (loss_sum, loss_items, *metric_sums.values())
        sums = reduced(acc, loss_sum, loss_items, metric_sums) if self.several_processes else window_sums
        tokens = self.throughput.take_tokens()
        reading = acc.read_async(*sums) if tokens is None else acc.read_async(*sums, tokens)
        window = LogWindow(step, reading, state.loss_batches - self.window_first_batch,
                           time.perf_counter() - self.window_start, state.epoch,
                           # The highest group rate: optim.lr's schedule (with optim.layer_decay, the head's).
                           max(self.c.scheduler.get_last_lr()), names)
        if acc.reads_lag:
            self.write_late_log()  # a window closed at once after another (the run's end) keeps its line
            self.late_log = window
        else:
            self.write_log(*window)
        if keep_window:
            self.window_first_batch = state.loss_batches  # logged up to here
            return
        # New sums: the last ones are the reader's.
        state.loss_sum, state.loss_items = torch.zeros_like(loss_sum), torch.zeros_like(loss_items)
        state.metric_sums = {}  # begun again by the window's first micro-batch
        state.loss_batches = 0
        self.window_start, self.window_first_batch = time.perf_counter(), 0

    def log_unfinished_window(self) -> None:
        """The line of the steps trained since the last log line, where training ends before the next
        log step (its end, a stop signal): written, but the window's sums stay in the state, so that a
        run resumed from the final checkpoint goes on with the window as if it had never stopped."""
        if self.state.loss_batches > self.window_first_batch:
            self.log_training_loss(self.state.global_step, keep_window=True)

    def write_late_log(self) -> bool:
        """Write the line :meth:`log_training_loss` left for later, if any; whether there was one."""
        window, self.late_log = self.late_log, None
        if window is None:
            return False
        self.write_log(*window)
        return True

    def write_log(self, step: int, reading: HostRead, batches: int, seconds: float, epoch: int, lr: float,
                  metric_names: tuple[str, ...]) -> None:
        """A window's line (the fields of a :class:`LogWindow`): the training loss (the mean over the
        window's items), the task's own metrics (means over the same items), the learning rate and the
        throughput (samples/s, tokens/s, MFU: ``app.engine.throughput``); a loss that is not finite is
        recorded, and stops training with stop_on_nan."""
        values = reading.result()
        loss = values[0] / max(values[1], 1)  # no items (every label masked): no loss to speak of
        task_metrics = logged(metric_names, values[2:2 + len(metric_names)], values[1], self.c.task)
        tokens = values[2 + len(metric_names):]
        train_metrics = {
            "train/loss": loss,
            **task_metrics,
            "train/lr": lr,
            **self.throughput.window(batches, seconds, tokens[0] if tokens else None),
            "epoch": epoch,
        }
        self.acc.log(train_metrics, step=step)
        self.progress.show(loss, train_metrics, task_metrics)
        if not math.isfinite(loss):
            state = self.state
            if state.non_finite_loss_step is None:
                state.non_finite_loss_step = step
            if self.stop_on_nan and self.stop is not StopReason.non_finite_loss:  # the first one names the stop
                self.stop_for(StopReason.non_finite_loss, loss=loss, step=step)
                self.acc.set_trigger()

    def evaluate(self) -> dict[str, float]:
        """An evaluation during training (after any training line left for later); early stopping may
        decide to stop (every process, through the trigger)."""
        self.write_late_log()
        metrics, no_improvement = run_evaluation(self.c, self.state, self.stopper)
        if no_improvement:
            stopper = self.stopper
            self.stop_for(StopReason.no_improvement, monitor=stopper.monitor, evaluations=stopper.bad_evaluations,
                          best=human(stopper.best))
            self.acc.set_trigger()
        # A pruned sweep's trial reports every scheduled evaluation to its study, which may stop it.
        pruned = self.c.pruning.after_evaluation(self.state.global_step, self.state.epoch, metrics,
                                                 self.stop is not None)
        if pruned is not None:
            self.stop_for(StopReason.pruned, why=pruned)
            self.acc.set_trigger()
        return metrics

    def stop_for(self, reason: StopReason, **fields: Any) -> None:
        """Decide to stop for ``reason`` (a later reason of the same step replaces an earlier one)."""
        self.stop = reason
        self.state.stop_reason = reason.sentence(**fields)

    def stop_unless_decided(self, reason: StopReason) -> None:
        if self.stop is None:
            self.stop_for(reason)

    def close(self) -> None:
        self.log_unfinished_window()  # unless the epoch's end wrote it
        self.write_late_log()
        if self.signals is not None:
            self.signals.close()  # the last step's flag (a signal then is read by fit's final agreement)


def _signal_check(interrupts: StopSignals | None, flag: StepFlag | None) -> Callable[[], bool] | None:
    """Whether a stop signal was seen, asked after every step: this process's own (one process), or
    any process's through the step flag (several). None without interrupts: nothing to ask."""
    if interrupts is None:
        return None
    if flag is None:
        return lambda: interrupts.received is not None
    return lambda: flag.post(interrupts.received is not None)


def run_evaluation(c: Components, state: LoopState, stopper: EarlyStopping) -> tuple[dict[str, float], bool]:
    """Evaluate, record the metrics in the state, log them; returns them and whether early stopping
    says to stop."""
    acc = c.accelerator
    metrics = evaluate(c)
    metrics["epoch"] = state.epoch
    state.last_metrics = metrics
    state.last_eval_step = state.global_step
    acc.log(metrics, step=state.global_step)
    log.info("step %d: %s", state.global_step, human_metrics(metrics, prefix="eval/"))
    if isinstance(c.task, WritesSamples):
        write_samples(c, c.task, state.global_step)
    return metrics, stopper.update(metrics, state.global_step)
