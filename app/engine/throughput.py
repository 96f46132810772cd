"""Training throughput as the log shows it: ``train/samples_per_s``, ``train/tokens_per_s`` (tasks
that count tokens) and ``train/mfu`` in every training log line and ``metrics.jsonl`` row, and their
means over the run in its last line.

- **Tokens**: a task may count the tokens of a batch (``Task.tokens_in_batch``: an int, or a 0-d
  tensor on the batch's device, which spares a host read per batch; a text task's non-padding tokens,
  a language model's label tokens). They are summed on the device as the batches are drawn and read
  at log steps with the loss (``take_tokens``); a task without it has no tokens key, and its steps pay
  nothing for it.
- **FLOPs**, forward and backward, as torchtitan counts them: a transformer (a module whose config
  names its layers, heads and width) costs ``6·N + 12·L·H·Q·T`` per token, N its parameters outside
  the embedding tables, L layers, H heads of width Q, T the window's mean sequence length (its tokens
  per sample); any other model ``6·N`` per sample. A task may know better: ``flops_per_token()``.
- **MFU**, as Lightning's ``ThroughputMonitor`` reports ``device/mfu``: FLOP/s per device divided by the
  device's peak for the run's precision (``hardware.peak_tflops``, else ``Accelerator.peak_flops``); null where that
  peak is unknown (CPU). A fraction: 0.45 is 45 %.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from app.distributed import Accelerator
from app.engine.progress import throughput_text

SAMPLES_PER_S = "train/samples_per_s"
TOKENS_PER_S = "train/tokens_per_s"
MFU = "train/mfu"


def transformer_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(layers, heads, head width) of the first module whose config gives them (a Transformers
    model; the encoder inside a task's own head), else None."""
    for module in model.modules():
        config = getattr(module, "config", None)
        layers = getattr(config, "num_hidden_layers", None)
        heads = getattr(config, "num_attention_heads", None)
        width = getattr(config, "hidden_size", None)
        if isinstance(layers, int) and isinstance(heads, int) and isinstance(width, int) and heads > 0:
            head_width = getattr(config, "head_dim", None)
            return layers, heads, head_width if isinstance(head_width, int) else width // heads
    return None


def dense_parameters(model: nn.Module) -> int:
    """Parameters that take part in matrix products: all but the embedding tables' (a lookup), unless
    another module uses the same tensor (a language model's tied output layer)."""
    embedding: dict[int, int] = {}
    used_elsewhere: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                embedding[id(p)] = p.numel()
            else:
                used_elsewhere.add(id(p))
    total = sum(p.numel() for p in model.parameters())
    return total - sum(n for pid, n in embedding.items() if pid not in used_elsewhere)


class Throughput:
    """The throughput of each log window (:meth:`window`) and of the whole run (:meth:`means`)."""

    def __init__(self, accelerator: Accelerator, task: Any, model: nn.Module, global_batch: int,
                 peak_flops: float | None):
        """``peak_flops``: one device's peak FLOP/s for the run's precision (``hardware.peak_tflops``, else
        ``Accelerator.peak_flops()``); None: unknown, MFU null."""
        self.acc = accelerator
        self.global_batch = global_batch
        self.several_processes = accelerator.num_processes > 1
        inner = accelerator.unwrap_model(model)
        dense = dense_parameters(inner)
        self.flop_fraction = 1.0 / (accelerator.num_processes * peak_flops) if peak_flops else None
        """What one FLOP per second of the whole run is of the devices' peak (None: peak unknown)."""
        self.mfu_per_sample = 6.0 * dense * self.flop_fraction if self.flop_fraction is not None else None
        self.count_tokens = getattr(task, "tokens_in_batch", None)
        """The task's token count per batch, or None (no tokens key, nothing done per step)."""
        self.tokens = torch.zeros((), dtype=torch.int64, device=accelerator.device)
        """This process's tokens drawn since the last log step, summed on the device."""
        given = getattr(task, "flops_per_token", None)
        self.task_flops_per_token: float | None = float(given()) if callable(given) else None
        shape = transformer_shape(inner)
        self.dense_flops_per_token = 6.0 * dense
        self.attention_flops = 12.0 * shape[0] * shape[1] * shape[2] if shape is not None else 0.0
        """Per token and per token of sequence length (``12·L·H·Q``)."""
        self.seconds = self.samples = self.tokens_total = self.flops = 0.0
        """The logged windows' totals: the run's means."""
        self.window = self._window_with_tokens if self.count_tokens is not None else self._window
        """``window(batches, seconds, tokens)``: the metrics of a log window of ``batches`` micro-batches
        per process that took ``seconds``, in which ``tokens`` were drawn (what :meth:`take_tokens` gave,
        read; None for a task that does not count them)."""

    def counted(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches``, each one's tokens added to :attr:`tokens` as it is drawn (a device op: no sync
        unless the task read its count back itself)."""
        count = self.count_tokens
        assert count is not None
        for batch in batches:
            self.tokens += count(batch)  # the attribute: a log step starts a new sum (take_tokens)
            yield batch

    def take_tokens(self) -> torch.Tensor | None:
        """The tokens drawn since the last log step (summed over processes), for a log step to read
        (``Accelerator.read_async``); counting goes on in a new tensor, as the one returned is being
        read. None for a task that does not count tokens."""
        if self.count_tokens is None:
            return None
        tokens = self.acc.reduce(self.tokens, reduction="sum") if self.several_processes else self.tokens
        self.tokens = torch.zeros_like(self.tokens)
        return tokens

    def flops_per_token(self, sequence_length: float) -> float:
        if self.task_flops_per_token is not None:
            return self.task_flops_per_token
        return self.dense_flops_per_token + self.attention_flops * sequence_length

    def _window(self, batches: int, seconds: float, tokens: float | None) -> dict[str, float | None]:
        """Samples/s and MFU (6·N per sample). Kept short: it runs at every log step of every task."""
        samples = batches * self.global_batch
        self.samples += samples
        self.seconds += seconds
        per_s = samples / seconds
        return {SAMPLES_PER_S: per_s, MFU: per_s * self.mfu_per_sample if self.mfu_per_sample is not None else None}

    def _window_with_tokens(self, batches: int, seconds: float, tokens: float | None) -> dict[str, float | None]:
        """Samples/s, tokens/s and MFU per token."""
        assert tokens is not None
        samples = batches * self.global_batch
        flops = tokens * self.flops_per_token(tokens / max(samples, 1))
        self.samples += samples
        self.seconds += seconds
        self.tokens_total += tokens
        self.flops += flops
        fraction = self.flop_fraction
        return {SAMPLES_PER_S: samples / seconds, TOKENS_PER_S: tokens / seconds,
                MFU: flops / seconds * fraction if fraction is not None else None}

    def means(self) -> dict[str, float | None]:
        """The run's throughput over every logged window (each figure's mean, weighted by the windows'
        time); {} before the first log line."""
        if not self.seconds:
            return {}
        per_s = self.samples / self.seconds
        if self.count_tokens is None:
            return {SAMPLES_PER_S: per_s, MFU: per_s * self.mfu_per_sample if self.mfu_per_sample is not None else None}
        fraction = self.flop_fraction
        return {SAMPLES_PER_S: per_s, TOKENS_PER_S: self.tokens_total / self.seconds,
                MFU: self.flops / self.seconds * fraction if fraction is not None else None}

    def summary(self) -> str:
        """``mean 812 samples/s, 30512 tokens/s, MFU 41.2%`` (``MFU n/a`` where the device's peak is
        unknown); "" before the first log line."""
        means = self.means()
        return "mean " + throughput_text(means, unknown_mfu="MFU n/a") if means else ""
