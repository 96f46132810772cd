"""The task interface: what the engine needs from a task, and nothing more.

A task builds its datasets (with a collate function), builds its model, runs one forward pass on a
batch, and turns gathered outputs and targets into metrics. The engine owns everything else
(devices, processes, precision, the loop, checkpoints, export), so a new task is one small module,
inside ``app/tasks`` or in the user's own package (``_target_`` in a task YAML: ``app/tasks/external.py``).

What a task may ask of the runtime while it builds its data is :class:`TaskRuntime` (the
Accelerator satisfies it). Optional abilities are their own protocols, which the engine checks for
where it uses them: :class:`PredictsTest` (predictions on an unlabeled test split),
:class:`CountsTokens` (``tokens_in_batch``: the training log's ``train/tokens_per_s``),
:class:`KnowsFlops` (``flops_per_token``: its ``train/mfu``), :class:`SummedMetrics` (metrics from
per-process sums reduced across processes, instead of gathered per-sample outputs: a language model's
loss and perplexity), :class:`CheckpointsBlocks` (``trainer.gradient_checkpointing`` for a model that
is not a Transformers one), :class:`DeclaresAdapterTaskType` (peft's task type, where the model's
class does not say it) and :class:`DescribesData` (the log's account of the data), :class:`DescribesItself` (what the model card says of the model and the
data), :class:`ReadsStepTotals` (sums over the whole optimizer step before any of it is trained: KTO's KL
estimate) and :class:`AfterOptimizerStep` (a task's own update after each optimizer step: TR-DPO's reference). Sample lengths for ``trainer.group_by_length`` are :attr:`TaskData.train_lengths` (None: the
task gives none); further evaluation sets (GLUE MNLI's mismatched one) are :attr:`TaskData.extra_eval`.
A training split may be a stream (``app.distributed.data.stream.ShardedStream``: each process reads its
own part and checkpoints its own position); the config must then say so
(``TaskConfig.streams_training_data``).

Nothing here is specific to classification: ``StepOutput.logits`` and ``labels`` are whatever
``compute_metrics`` needs per sample, gathered across processes with the padding duplicates removed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass
class TaskData:
    train: Dataset
    eval: Dataset
    collate_fn: Callable[[list[Any]], Any] | None = None
    train_lengths: Sequence[int] | None = None
    """Length of each training sample (e.g. tokens), for ``trainer.group_by_length``; None if the
    samples all cost the same."""
    extra_eval: dict[str, Dataset] = field(default_factory=dict)
    """Further evaluation sets by name, evaluated after ``eval`` with the same collate function; their
    metrics are reported as ``eval/<metric>_<name>`` (GLUE MNLI: ``{"mm": mismatched}`` gives
    ``eval/accuracy_mm``). Their names belong in ``metric_names`` too."""


NO_OUTPUTS = torch.empty(0)
"""StepOutput's logits and labels when the engine reads none (a :class:`SummedMetrics` task)."""


@dataclass
class StepOutput:
    """What one forward pass gives the engine: the loss to train on and, for evaluation, the outputs
    and targets that ``compute_metrics`` reads.

    The loss comes in one of two forms. **Per sample with its items** (``sample_losses`` and
    ``sample_items``): each sample's loss summed over its items (a language model's predicted tokens,
    a classifier's one sample, a multi-label classifier's label cells), and how many items that is.
    The engine then trains on the sum over every item of the optimizer step divided by their number,
    across gradient accumulation and processes (the duplicates that complete an epoch's last global
    batch left out): an update does not change with how the step's batch is split. **A mean**
    (``loss`` alone): every micro-batch weighs alike, its mean loss divided by the accumulation steps
    and averaged over the processes (Accelerate's rule); right when all micro-batches hold the same
    number of items, approximate otherwise.

    >>> losses = F.cross_entropy(logits, y, reduction="none")      # one per sample
    >>> StepOutput(sample_losses=losses, sample_items=1, logits=logits, labels=y)
    """

    loss: torch.Tensor | None = None
    """The batch's mean loss, a 0-d tensor; None when ``sample_losses`` is given (the engine sums those)."""
    logits: torch.Tensor = NO_OUTPUTS
    """One row per sample: the model's outputs that ``compute_metrics`` reads (any trailing shape)."""
    labels: torch.Tensor = NO_OUTPUTS
    """One entry (or row) per sample: the targets that ``compute_metrics`` reads."""
    sample_losses: torch.Tensor | None = None
    """One entry per sample (1-d, on the batch's device): the sum of that sample's item losses."""
    sample_items: torch.Tensor | int | None = None
    """The items each of ``sample_losses`` sums: a 1-d tensor with one count per sample (tokens), or one
    number for every sample (1: samples). A 0-d count on the device is never read on the host."""
    sample_metrics: dict[str, torch.Tensor] | None = None
    """The task's own training metrics, by name: each one entry per sample (1-d, on the batch's device),
    summed over that sample's items like ``sample_losses`` (with ``sample_items=1``, the sample's value).
    The engine sums them over the logging window on the device (detached) and logs ``train/<name>``,
    the window's sum over its items: the same mean as ``train/loss`` (``app/engine/window_metrics.py``).
    Training only: evaluation does not read them. Needs ``sample_losses``."""
    sample_metric_items: dict[str, torch.Tensor] | None = None
    """For a metric of ``sample_metrics`` whose mean is not over the loss's items, the count each sample's
    value sums (1-d, one entry per sample, 0 where the sample has no value): ``train/<name>`` is then the
    window's sum over the window's sum of these counts (task=grpo: a per-token metric counts tokens, a
    per-completion one 1, a per-generation one 1 on one sample), left out of a window where they sum to 0.
    Every micro-batch should give the same names, so that every process sums the same ones."""
    sample_minima: dict[str, torch.Tensor] | None = None
    """The task's training metrics that are a minimum, not a mean (TRL's reward model's ``min_reward``): by
    name, each sample's smallest value (1-d, on the batch's device); ``train/<name>`` is the smallest over the
    logging window's samples, on every process. Like ``sample_metrics`` otherwise. Needs ``sample_losses``."""
    sample_maxima: dict[str, torch.Tensor] | None = None
    """The same for a maximum (``max_reward``)."""

    def __post_init__(self) -> None:
        if (self.loss is None) == (self.sample_losses is None):
            raise ValueError("StepOutput takes either loss (the batch's mean) or sample_losses (with sample_items).")
        if self.sample_losses is not None and self.sample_items is None:
            raise ValueError("StepOutput(sample_losses=...) needs sample_items: how many items each sample's loss sums.")
        if self.sample_metrics is not None and self.sample_losses is None:
            raise ValueError("StepOutput(sample_metrics=...) needs sample_losses: the metrics are averaged over "
                             "the same items as the loss.")
        if self.sample_metric_items is not None and not set(self.sample_metric_items) <= set(self.sample_metrics or {}):
            raise ValueError("StepOutput(sample_metric_items=...) names metrics that sample_metrics does not give.")
        if (self.sample_minima is not None or self.sample_maxima is not None) and self.sample_losses is None:
            raise ValueError("StepOutput(sample_minima=..., sample_maxima=...) needs sample_losses: they are over "
                             "the same samples as the loss.")

    def mean_loss(self) -> torch.Tensor:
        """This batch's loss per item (0-d): what a one-batch step trains on, in either form."""
        if self.sample_losses is None:
            assert self.loss is not None
            return self.loss
        items = self.sample_items
        assert items is not None  # see __post_init__
        total = items.sum() if isinstance(items, torch.Tensor) else items * self.sample_losses.numel()
        return self.sample_losses.sum() / total


class TaskRuntime(Protocol):
    """The runtime as a task sees it while building its data (the Accelerator is one)."""

    @property
    def is_main_process(self) -> bool:
        """True on the one process that shows progress and fills shared caches first."""
        ...

    @property
    def static_shapes(self) -> bool:
        """True when every step must see the same tensor shapes (XLA): pad to a fixed length."""
        ...

    def main_process_first(self) -> AbstractContextManager[None]:
        """The main process runs the block first (filling caches), then the others."""
        ...

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save these objects (``state_dict``/``load_state_dict``, JSON-able) with every checkpoint and
        restore them on resume and ``mode=eval``: state the task derives from its data and a resumed
        run must agree with (text_classification's label set), or a model that changes beside the
        trained one (an ``nn.Module``, saved as models are: a reference that moves). Call it on every
        process, in ``build_data`` or ``build_model``, in the same order each time."""
        ...

    @property
    def num_processes(self) -> int:
        ...

    @property
    def process_index(self) -> int:
        ...

    @property
    def device(self) -> torch.device:
        """This process's device (where the prepared model runs)."""
        ...

    @property
    def shards_the_model(self) -> bool:
        """True where the model's parameters are sharded across processes (FSDP2): every process must run
        each of its forward passes, generation included."""
        ...

    @property
    def project_dir(self) -> Path | None:
        """The run folder (None: a runtime made without one), where a task may write what a run produces
        (the main process only)."""
        ...

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce across the processes (``sum``, ``mean``, ``max``, ``min``): every process calls it."""
        ...

    def gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` (picklable), to every process; lists are concatenated."""
        ...

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """With ``evaluation_mode=True``: a second, frozen model that runs forward beside the trained one
        (a reference, a teacher), placed, sharded and autocast as the trained model will be. The trained
        model itself is the engine's to prepare."""
        ...


class Task(Protocol):
    """What the engine drives. A task outside ``app/`` also names its config schema (``config_class``,
    a dataclass subclassing ``app.config.TaskConfig``) and is built as ``Task(config)``."""

    name: str

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The keys compute_metrics returns (the engine logs them as ``eval/<name>``), those of the
        ``extra_eval`` sets with their suffix: checked against ``early_stopping.monitor`` before anything
        runs, and again after ``build_data`` (a task may learn them from its data). A class attribute
        will do."""
        ...

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        """Load and preprocess the datasets (``runtime``: the Accelerator, see :class:`TaskRuntime`).
        Bad data is refused with ``app.config.ConfigError`` (one sentence; the run exits 2)."""
        ...

    def build_model(self) -> nn.Module: ...

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """One forward pass on a batch already on the right device (training and evaluation;
        ``model.training`` tells them apart)."""
        ...

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Metrics over the whole, gathered and de-duplicated evaluation set (keys without prefix)."""
        ...

    def save_artifacts(self, model: nn.Module, folder: Path) -> None:
        """Write whatever besides weights makes the exported model usable (tokenizer, config...)."""
        ...


@runtime_checkable
class PredictsTest(Protocol):
    """A task that predicts its unlabeled test split (``task.predict_test=true``; its schema then has
    the field: :class:`app.config.PredictsTestConfig`). Used by ``app/engine/predict.py``."""

    def test_dataset(self) -> Any:
        """The test split, in file order, as the evaluation loader's collate function takes it."""
        ...

    def predict(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The model's outputs (e.g. logits) for a batch already on the right device, one row per sample."""
        ...

    def write_predictions(self, outputs: torch.Tensor, path: str | Path) -> None:
        """Turn the test split's gathered outputs (``predict``'s rows, in file order) into predictions
        and write them (the main process only calls it)."""
        ...


@runtime_checkable
class CountsTokens(Protocol):
    """A task whose batches have tokens worth counting: the training log then shows
    ``train/tokens_per_s`` (and MFU is counted per token; see ``app/engine/throughput.py``)."""

    def tokens_in_batch(self, batch: Any) -> int | torch.Tensor:
        """The tokens of a training batch (already on the device) that the model learns from: a text
        classifier's non-padding tokens (its attention mask's sum), a language model's label tokens.
        Called once per micro-batch as it is drawn. An int is fine; a 0-d integer tensor on the batch's
        device (``mask.sum()``, no ``.item()``) is summed there and read only at log steps, which
        spares an accelerator a host sync per batch."""


@runtime_checkable
class CheckpointsBlocks(Protocol):
    """A task whose model, not a Transformers one, can recompute its activations block by block
    (``trainer.gradient_checkpointing=true``: ``app/engine/activation_checkpointing.py`` runs each
    block's forward under ``torch.utils.checkpoint``). A Transformers model needs none of this."""

    def checkpoint_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose inner activations are recomputed in the backward pass (e.g. the layers of
        a stack); each must take and return tensors."""
        ...


@runtime_checkable
class KnowsFlops(Protocol):
    """A task that knows its model's training cost better than the engine's estimate (6·N + 12·L·H·Q·T
    per token for a transformer, 6·N per sample otherwise)."""

    def flops_per_token(self) -> float:
        """FLOPs of one training token, forward and backward (used with :class:`CountsTokens`)."""


@runtime_checkable
class DeclaresAdapterTaskType(Protocol):
    """A task that names peft's task type for its model (``adapter=lora``): ``"SEQ_CLS"``,
    ``"CAUSAL_LM"``, ``"TOKEN_CLS"``… Without it the model's class name decides
    (``…ForSequenceClassification``, ``…ForCausalLM``; ``app/engine/adapters.py``)."""

    peft_task_type: str | None


@runtime_checkable
class DescribesItself(Protocol):
    """A task that tells the model card (``model/README.md``) what its model and data are."""

    def card_facts(self) -> dict[str, str]:
        """Short markdown values by heading, in order: ``base model`` (a hub name or folder, or how the
        model is built), ``data`` (files, folder or hub name), ``labels``…"""
        ...


@runtime_checkable
class DescribesData(Protocol):
    """A task that says what the run learns from, once ``build_data`` has built it: the log's ``data:``
    line at the start (without it, the engine gives the splits' sizes)."""

    def data_summary(self) -> list[str]:
        """Short clauses, one per fact, in order: each split's source and size (rows; tokens for a
        language model), the label mapping (``no=0, yes=1``), the rows cut or dropped."""
        ...


@runtime_checkable
class SkipsRows(Protocol):
    """A task that leaves bad rows of its data out (``task.bad_rows=skip``): the engine writes them to
    ``<run>/skipped_rows.jsonl`` once the data is built, so a user can read what was not trained on and why."""

    def skipped_rows(self) -> list[dict[str, Any]]:
        """One JSON-able object per row left out: its file, place (``line``, ``row`` or ``byte``), ``reason``
        and ``row`` (as it came); [] for none."""
        ...


@dataclass(frozen=True)
class BatchPlan:
    """How a :class:`MakesTrainingBatches` task's loader batches become micro-batches."""

    draws: int
    """``trainer.batch_size`` times this many rows make one loader batch (per process)."""
    micro_batches: int
    """The micro-batches made of one loader batch."""
    samples: int
    """The samples (rows) a micro-batch holds, for the throughput's samples/s (task=grpo: completions)."""
    sentence: str
    """What the start of the run says of it (task=grpo: the completions an optimizer step trains on)."""


@runtime_checkable
class MakesTrainingBatches(Protocol):
    """A task that trains on what it makes of its data rather than on the data itself (``task=grpo``: a
    batch of prompts -> completions generated with the current weights, scored, cut into micro-batches).
    The engine's loop is unchanged: it iterates micro-batches of a loader the runtime expands
    (``Accelerator.expand_batches``: lengths, positions, resumption and gradient accumulation counted in
    micro-batches); the task checkpoints what it makes (``register_for_checkpointing``), so that a run resumed
    in the middle of a loader batch trains on the rest of its micro-batches instead of making them again."""

    def batch_plan(self, batch_size: int, accumulation: int, processes: int) -> BatchPlan:
        """How many rows a loader batch holds and how many micro-batches it makes, for this run's
        ``trainer.batch_size``, ``trainer.gradient_accumulation_steps`` and number of processes (called once,
        after ``build_data``, before any batch is made)."""
        ...

    def training_batches(self, model: nn.Module, batch: Any, step: int) -> list[Any]:
        """The micro-batches (``BatchPlan.micro_batches`` of them, in training order, as ``step`` takes them) of a
        loader batch already on the device, made with ``model`` (prepared, in training mode) before the optimizer
        step ``step``; the runtime places them on the device. Every process calls it at the same time."""
        ...

    def pending_batches(self) -> list[Any]:
        """The micro-batches of the latest loader batch again, as restored from a checkpoint (a resumed run
        skips those trained before it)."""
        ...


@runtime_checkable
class PacksSamples(Protocol):
    """A dataset whose rows each hold several of the task's samples (``task.packing=true``: conversations,
    preference pairs packed into rows). What a user reads counts the samples, not the rows:
    ``eval/num_samples`` and the model card's splits (with the rows beside them)."""

    def samples_packed(self) -> int:
        """How many samples the rows hold, in all."""
        ...


def samples_in(dataset: Any, rows: int) -> int:
    """The task's samples in a dataset of ``rows`` rows (``eval/num_samples``, the model card): the
    conversations or pairs its rows hold when they are packed (:class:`PacksSamples`), else the rows."""
    return dataset.samples_packed() if isinstance(dataset, PacksSamples) else rows


@runtime_checkable
class WritesSamples(Protocol):
    """A task that shows what the model generates at each evaluation during training (``task=sft``'s
    ``task.sample_prompts``): the engine writes the rows to ``<run>/samples/step_<N>.jsonl`` and to the
    trackers (``Accelerator.log_table``)."""

    def evaluation_samples(self, model: nn.Module, device: torch.device) -> list[dict[str, str]]:
        """The rows (the same keys each; [] for none) for ``model`` (in eval mode, with the weights being
        evaluated). Called on the main process with the unwrapped model, or, where the model is sharded
        (FSDP2: every process must run its forward passes), on every process with the model as trained;
        only the main process's rows are kept."""
        ...


@runtime_checkable
class SummedMetrics(Protocol):
    """A task whose evaluation metrics are functions of sums over the evaluation samples (a language
    model's: summed token losses over token counts). Each process sums its own samples on its
    device and the sums are reduced across processes once per evaluation: nothing per sample, let
    alone vocabulary-sized logits, is gathered, and ``compute_metrics`` is not called. Used by
    ``app/engine/loop.py``'s ``evaluate_sums``."""

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per-sample quantities to sum, by name, for a batch already on the device: each a 1-d tensor
        with one entry per sample (the engine drops the duplicates that complete the last global batch,
        sums each over the evaluation set and reduces it across processes). ``num_samples`` is the
        engine's own key."""
        ...

    def metrics_from_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """The evaluation set's metrics (keys without prefix, those of ``metric_names``) from the sums
        over all its samples; every process calls it with the same sums."""
        ...


@runtime_checkable
class ReadsStepTotals(Protocol):
    """A task whose loss reads totals over its whole optimizer step (every micro-batch, every process),
    so that the loss is the same at any batch split: KTO's KL estimate z, the token count that an NLL
    term averages over. Before the step's first micro-batch is trained, the engine draws the step's
    micro-batches, sums :meth:`step_sums` over them (without gradients; the duplicates that complete an
    epoch's last global batch left out), reduces the sums across processes and hands them to
    :meth:`begin_step`; then it trains the micro-batches one by one as usual
    (``app/engine/step_totals.py``). Training only: evaluation batches get no totals."""

    @property
    def reads_step_totals(self) -> bool:
        """Whether this run needs the totals at all (the engine then draws steps ahead); False: never asked."""
        ...

    def step_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per-sample quantities (each 1-d, one entry per sample) of a training batch already on the
        device, by name, computed under ``torch.no_grad()`` with the model in training mode."""
        ...

    def begin_step(self, totals: dict[str, torch.Tensor]) -> None:
        """The step's sums (0-d tensors on the device, over every micro-batch of every process), before
        the first ``step()`` of the step."""
        ...


@runtime_checkable
class AfterOptimizerStep(Protocol):
    """A task that updates something of its own after each optimizer step (TR-DPO's reference moving
    towards the policy), on every process, before the step is logged, evaluated or checkpointed."""

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        """``model``: the trained model as prepared; ``step``: the optimizer steps taken so far."""
        ...


@runtime_checkable
class DerivesTrainingMetrics(Protocol):
    """A task whose training metrics are not all means over the window's items: it turns the window's
    sums of its ``StepOutput.sample_metrics`` into the logged values itself (task=kto: ``rewards/chosen``
    over the desirable answers alone, ``rewards/margins`` a difference of two such means)."""

    def training_metrics(self, sums: dict[str, float], items: float) -> dict[str, float]:
        """The values logged as ``train/<name>`` (names without the prefix) from the window's sums over
        every process (by ``sample_metrics`` name) and the items its loss sums."""
        ...
