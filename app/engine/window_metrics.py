"""A task's own training metrics (``StepOutput.sample_metrics``: task=dpo's rewards and log-probabilities)
in the logging window, beside the training loss, and kept like it:

- summed on the device as each micro-batch is trained (detached; the duplicates that complete an epoch's
  last global batch left out, as for the loss): no host sync per step;
- reduced across processes at a log step in the window's one collective, stacked with the loss's sums;
- logged as ``train/<name>``: the window's sum over the window's items, the mean ``train/loss`` is (for a
  task whose items are samples, the mean per sample), in the same line, ``metrics.jsonl`` row and
  tracker call as ``train/loss``; or what the task derives from the sums (``DerivesTrainingMetrics``:
  task=kto's means over the desirable answers alone);
- held in the loop state as host floats by a checkpoint, every process's own (``TrainerState``), so a
  run resumed mid-window logs what the uninterrupted run logs.

The sums are a dict by name, in the order the task gives them: every process runs the same task, so
every process stacks them in the same order. A metric that is a minimum or a maximum over the window's
samples (``StepOutput.sample_minima`` / ``sample_maxima``: task=reward_model's ``min_reward``) is kept in
the same dict as ``<name>#min`` / ``<name>#max``, the running extreme instead of a sum, reduced across
processes with one more collective (a maximum; a minimum as the maximum of its negation) and logged as it is.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from app.tasks.base import DerivesTrainingMetrics, StepOutput

PREFIX = "train/"

MetricSums = dict[str, "float | torch.Tensor"]
"""The window's sums by metric name: device tensors while training, floats in a checkpoint."""


ITEMS = "#items"
"""The key of a metric's own item count in the sums (``<name>#items``: ``StepOutput.sample_metric_items``)."""


def add_sample_metrics(acc: Any, sums: MetricSums, metrics: dict[str, torch.Tensor] | None,
                       items: dict[str, torch.Tensor] | None = None) -> None:
    """Add a micro-batch's per-sample metrics (this process's real samples) to the window's sums, on
    the device, and the counts of those that have their own (``items``, kept as ``<name>#items``). A new
    tensor each time, never an in-place change: a closed window's sums are its reader's."""
    if not metrics:
        return
    own = {name + ITEMS: count for name, count in (items or {}).items()}
    for name, values in acc.local_for_metrics({**metrics, **own}).items():
        total = values.detach().float().sum()
        sums[name] = sums[name] + total if name in sums else total


MIN, MAX = "#min", "#max"
"""The suffixes of a window's running minimum and maximum in its sums."""


def add_sample_extremes(acc: Any, sums: MetricSums, minima: dict[str, torch.Tensor] | None,
                        maxima: dict[str, torch.Tensor] | None) -> None:
    """Fold a micro-batch's per-sample minima and maxima (this process's real samples) into the window's running
    ones, on the device; a micro-batch with no real sample on this process adds the neutral ±inf, so that every
    process holds the same names."""
    if not minima and not maxima:  # most tasks keep no extremes: nothing to do on the step's hot path
        return
    # Tensor.min()/max(), not torch.amin/amax: torch_xla 2.9's amin/amax without a dim return the tensor unreduced.
    for suffix, by_name, extreme, keep in ((MIN, minima, torch.Tensor.min, torch.minimum),
                                           (MAX, maxima, torch.Tensor.max, torch.maximum)):
        for name, values in acc.local_for_metrics(by_name or {}).items():
            values = values.detach().float()
            value = extreme(values) if values.numel() else values.new_tensor(torch.inf if suffix == MIN else -torch.inf)
            key = name + suffix
            sums[key] = keep(torch.as_tensor(sums[key]), value) if key in sums else value


def reduced(acc: Any, loss_sum: torch.Tensor, loss_items: torch.Tensor, sums: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The window's loss, items and metric sums (in ``sums``' order) reduced across the processes: the sums in one
    collective with the loss's, the extremes (if any) in one more."""
    extremes = [name for name in sums if name.endswith((MIN, MAX))]
    summed = [name for name in sums if name not in extremes]
    totals = acc.reduce(torch.stack([loss_sum, loss_items, *(sums[name] for name in summed)])).unbind()
    out = dict(zip(summed, totals[2:], strict=True))
    if extremes:
        signed = torch.stack([-sums[name] if name.endswith(MIN) else sums[name] for name in extremes])
        peaks = acc.reduce(signed, reduction="max").unbind()
        out.update({name: -peak if name.endswith(MIN) else peak for name, peak in zip(extremes, peaks, strict=True)})
    return [totals[0], totals[1], *(out[name] for name in sums)]


def add_step_metrics(acc: Any, sums: MetricSums, out: StepOutput) -> None:
    """A trained micro-batch's own metrics into the window's: the sums of its means (with the counts of those
    that have their own) and its running extremes."""
    add_sample_metrics(acc, sums, out.sample_metrics, out.sample_metric_items)
    add_sample_extremes(acc, sums, out.sample_minima, out.sample_maxima)


def on_device(sums: MetricSums, device: torch.device) -> dict[str, torch.Tensor]:
    """A checkpoint's sums (floats) as running sums on the device; sums already there are kept (no op)."""
    return {name: value if isinstance(value, torch.Tensor) else torch.tensor(float(value), device=device)
            for name, value in sums.items()}


def as_floats(sums: MetricSums) -> dict[str, float]:
    """The sums as a checkpoint holds them (a host read each: only at a save)."""
    return {name: float(value) for name, value in sums.items()}


def logged(names: tuple[str, ...], values: tuple[float, ...], items: float, task: Any = None) -> dict[str, float]:
    """The window's ``train/<name>`` values from its reduced sums (``values``, in ``names`` order) over
    the items its loss sums (no items, every label masked: 0/1, as for the loss), or over the metric's
    own count (``<name>#items``; none in the window: not logged); a running extreme (``<name>#min`` /
    ``#max``) as it is. A task that derives its metrics from the sums itself (``DerivesTrainingMetrics``:
    a difference of two means) gives them instead of the means."""
    sums = dict(zip(names, values, strict=True))
    extremes = {PREFIX + name.removesuffix(MIN).removesuffix(MAX): value for name, value in sums.items()
                if name.endswith((MIN, MAX))}
    sums = {name: value for name, value in sums.items() if not name.endswith((MIN, MAX))}
    if isinstance(task, DerivesTrainingMetrics):
        return {**{PREFIX + name: value for name, value in task.training_metrics(sums, items).items()}, **extremes}
    out = {}
    for name, value in sums.items():
        if name.endswith(ITEMS):
            continue
        count = sums.get(name + ITEMS)
        if count is None:
            out[PREFIX + name] = value / max(items, 1)
        elif count > 0:
            out[PREFIX + name] = value / count
    return {**out, **extremes}


def restored(windows: list[dict[str, float]], rank: int, world_size: int) -> MetricSums | None:
    """This process's partial sums from a checkpoint's per-process ones (``windows``, one per process
    that saved it); with another number of processes, the mean per process (an approximation, as for
    the loss: the first window after the resume weighs the ranks alike). None: the checkpoint has none."""
    if len(windows) == world_size:
        return {**windows[rank]}
    if not windows:
        return None
    names = list(windows[0])
    return {name: min(w.get(name, math.inf) for w in windows) if name.endswith(MIN) else
            max(w.get(name, -math.inf) for w in windows) if name.endswith(MAX) else
            sum(w.get(name, 0.0) for w in windows) / len(windows) for name in names}
