"""Typed run configuration: one dataclass per Hydra config group, each with its own rules.

Every YAML under ``conf/`` names its schema first in ``defaults`` so a typo key, a wrong type or an
unknown enum value is rejected by Hydra when the config is composed, before anything trains.
``OmegaConf.to_object`` turns the composed config into these dataclasses once, at the entry point
(``app/cli/``); nothing below it reads a ``DictConfig``.

Where the rules live (each fails with one sentence as :class:`ConfigError`, exit 2):

- a group's own rules (``trainer.batch_size > 0``, ``total_limit >= 1``...): its ``check()``, beside
  its fields in this file; a task's in its schema (``app/tasks/*_config.py``);
- the rules of a hardware kind (devices, processes, precisions, what the kind cannot do): its spec's,
  in ``app/distributed/hardware/``;
- the two put together: ``app/launching/validate.py``, which sits above this module, the tasks and the
  hardware registry; the schemas put into Hydra's ConfigStore with the task registry's:
  ``app/cli/configure.py``.

This module is the lowest level of the application: it imports nothing from ``app``, so the tasks'
schemas and the hardware specs can import it (and answering a refused config needs no torch).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from omegaconf import MISSING


def as_plain(obj: Any) -> Any:
    """Config dataclasses as dicts, enums by value (what the YAML says)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: as_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [as_plain(o) for o in obj]
    if isinstance(obj, dict):
        return {k: as_plain(v) for k, v in obj.items()}
    return obj


class ConfigError(ValueError):
    """A run configuration that cannot work; the message is one sentence for the user."""


class InputError(RuntimeError):
    """Input that training meets only once it runs and cannot use (``task=grpo``: a reward function's
    output): the message is one sentence for the user; the run stops with exit status 1 and its folder,
    checkpoints included, stays as it was (a refused config, ``ConfigError``, leaves nothing behind)."""


def require_package(package: str, needed_by: str, extra: str, instead: str) -> None:
    """``<needed_by> needs the <package> package, which is not installed; ...`` when it is not (asked
    without importing it: a refused config answers before any heavy import)."""
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{needed_by} needs the {package} package, which is not installed; pip install -e "
                          f"\".[{extra}]\" (or pip install {package}), or {instead}.")


def require_positive(values: Mapping[str, float | None]) -> None:
    """``<key> must be positive, got <value>.`` for the first value that is not (None: unset, allowed)."""
    for key, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}.")


class HardwareKind(enum.Enum):
    """The ``hardware=`` options; each value has its spec in ``app/distributed/hardware/registry.py``."""

    cpu = "cpu"
    gpu = "gpu"
    multi_cpu = "multi_cpu"
    multi_gpu = "multi_gpu"
    fsdp = "fsdp"
    tpu = "tpu"


class MeshSharding(enum.Enum):
    """How ``hardware=tpu`` lays parameters and optimizer state on the SPMD mesh."""

    replicated = "replicated"
    fsdp = "fsdp"


class PrecisionMode(enum.Enum):
    no = "no"
    fp16 = "fp16"
    bf16 = "bf16"


class MonitorMode(enum.Enum):
    min = "min"
    max = "max"


class ExportChoice(enum.Enum):
    best = "best"
    last = "last"


class RunMode(enum.Enum):
    train = "train"
    eval = "eval"


class Tracker(enum.Enum):
    tensorboard = "tensorboard"
    wandb = "wandb"
    mlflow = "mlflow"


class AdapterKind(enum.Enum):
    """The ``adapter=`` options: train the whole model, or a peft adapter on it (app/engine/adapters.py)."""

    none = "none"
    lora = "lora"


@dataclass
class HardwareConfig:
    """Where the run executes."""

    kind: HardwareKind = HardwareKind.cpu
    """cpu, gpu (one CUDA device), multi_cpu (DDP on gloo), multi_gpu (DDP on nccl), fsdp (FSDP2),
    tpu (PyTorch/XLA, SPMD over a host's devices); see app/distributed/hardware/."""
    num_processes: int = 1
    """Worker processes on this machine; more than one needs a multi-process kind."""
    num_nodes: int = 1
    """Machines taking part; with more than one, launch with torchrun on every node."""
    collective_timeout_s: float = 120.0
    """A collective that waits longer than this fails the run instead of hanging it."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2 only: free the gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2)."""
    num_threads: int | None = None
    """torch's intra-op threads per process; null: one for a small model, else the process's share of the
    cores, at most OMP_NUM_THREADS when set (app/engine/threads.py)."""
    peak_tflops: float | None = None
    """One device's peak TFLOP/s for the run's precision: the denominator of the training log's
    ``train/mfu``. null: from the table of common GPUs and TPUs by the name the device reports
    (app/distributed/hardware/peak_flops.py); a device not in it (a CPU) logs a null MFU."""
    sharding: MeshSharding = MeshSharding.replicated
    """hardware=tpu only: ``replicated`` keeps a whole copy of the parameters and optimizer state on
    every device (data parallel); ``fsdp`` shards each of them over the devices of the mesh
    (PyTorch/XLA's FSDPv2), for models that do not fit one chip. Batches are split over the devices either way."""
    compile_cache_dir: str | None = None
    """hardware=tpu only: where XLA keeps the graphs it compiled, so an identical run compiles nothing
    again (a folder per process when there are several); null: ``xla_cache`` in the user's cache
    folder (``$XDG_CACHE_HOME/app``, else ``~/.cache/app``)."""

    def check(self) -> None:
        """The numbers themselves; whether the kind runs them here is its spec's rule."""
        require_positive({"hardware.num_processes": self.num_processes, "hardware.num_nodes": self.num_nodes,
                          "hardware.num_threads": self.num_threads})
        if self.collective_timeout_s <= 0:
            raise ConfigError("hardware.collective_timeout_s must be positive.")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError("hardware.peak_tflops must be positive (or null: from the device's name).")
        if self.sharding is not MeshSharding.replicated and self.kind is not HardwareKind.tpu:
            raise ConfigError(f"hardware.sharding={self.sharding.value} shards over the devices of the SPMD mesh and "
                              f"needs hardware=tpu; on CPUs or GPUs, hardware=fsdp shards over processes.")


@dataclass
class PrecisionConfig:
    """Numeric precision of forward/backward; weights and optimizer states stay in fp32."""

    mode: PrecisionMode = PrecisionMode.no


@dataclass
class OptimConfig:
    """The optimizer, built with ``hydra.utils.instantiate(optim, params=...)``."""

    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.01
    """Decoupled from biases and norm weights, which are never decayed."""
    layer_decay: float | None = None
    """Layer-wise LR decay in (0, 1]: block k from the top trains at lr * layer_decay**k, the
    embeddings lowest (app/engine/parameter_groups.py); null: one rate for all."""
    freeze: list[str] = field(default_factory=list)
    """Regular expressions over parameter names (``re.search``): the parameters that match one are not
    trained, e.g. ``[word_embeddings]``. Each must match some parameter; [] trains them all."""

    def check(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be a positive number, got {self.lr}.")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be 0 or more, got {self.weight_decay}.")
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            raise ConfigError(f"optim.layer_decay must be in (0, 1] (or null), got {self.layer_decay}.")
        for pattern in self.freeze:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"optim.freeze has {pattern!r}, which is not a regular expression ({e}).") from None


@dataclass
class AdamWConfig(OptimConfig):
    _target_: str = "torch.optim.AdamW"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    fused: bool | None = None
    """torch's fused AdamW kernel; null: fused wherever the hardware backend has it (CPU, CUDA)."""


@dataclass
class SGDConfig(OptimConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1
    weight_decay: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class SchedulerConfig:
    """Learning-rate schedule, stepped once per optimizer step (whatever the number of processes)."""

    _target_: str = "app.engine.schedulers.linear_with_warmup"
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps (takes precedence over warmup_ratio)."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of the total optimizer steps, used when warmup_steps is 0."""

    def check(self) -> None:
        if not 0.0 <= self.warmup_ratio < 1.0 or self.warmup_steps < 0:
            raise ConfigError("scheduler.warmup_ratio must be in [0, 1) and scheduler.warmup_steps 0 or more.")


@dataclass
class TrainerConfig:
    """The fixed training loop's knobs."""

    max_epochs: int = 10
    max_steps: int = -1
    """Optimizer steps to run; -1 means ``max_epochs`` decides. Given on the command line without
    ``max_epochs``, the steps alone decide (a task's preset epochs do not cut them short:
    ``app.cli.configure.limits_as_given``)."""
    batch_size: int = 32
    """Per process, per micro-batch."""
    eval_batch_size: int | None = None
    """Per process; defaults to batch_size."""
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value; null disables clipping."""
    eval_every_n_steps: int | None = None
    """Evaluate every N optimizer steps; null means at the end of every epoch."""
    log_every_n_steps: int = 10
    num_workers: int = 0
    """DataLoader worker processes per training process."""
    group_by_length: bool = False
    """Batch training samples of similar length together (less padding; the task must give lengths)."""
    ema_decay: float | None = None
    """Evaluate and export an exponential moving average of the weights, updated after every optimizer
    step with this decay (e.g. 0.99: about the last 100 steps); null: the weights as trained."""
    limit_eval_batches: int | None = None
    """Evaluate on the first N batches only (debug=fast_dev_run); null: the whole evaluation set."""
    overfit_batches: int = 0
    """Train and evaluate on the same first N batches, unshuffled (debug=overfit); 0: off."""
    compile: bool = False
    """torch.compile the model (``nn.Module.compile``: in place, so checkpoint and export keys do not
    change); refused with one sentence on hardware whose backend cannot compile."""
    deterministic: bool = False
    """torch's deterministic algorithms and the settings they need (app/distributed/determinism.py):
    bitwise repeatable runs on one machine, at some speed; an op without a deterministic version fails."""
    profile_steps: int = 0
    """Profile this many optimizer steps (after one skipped and one warm-up) with torch.profiler; the
    Chrome trace goes to <run folder>/profile/ (debug=profile); 0: off."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory, about a third
    more compute): a Transformers model through its gradient_checkpointing_enable, another model
    through torch.utils.checkpoint on the blocks its task declares; refused for a model that has neither
    (app/engine/activation_checkpointing.py)."""

    def check(self) -> None:
        require_positive({
            "trainer.batch_size": self.batch_size,
            "trainer.gradient_accumulation_steps": self.gradient_accumulation_steps,
            "trainer.log_every_n_steps": self.log_every_n_steps,
            "trainer.eval_batch_size": self.eval_batch_size,
            "trainer.eval_every_n_steps": self.eval_every_n_steps,
            "trainer.limit_eval_batches": self.limit_eval_batches,
            "trainer.max_grad_norm": self.max_grad_norm,
        })
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"trainer.max_steps={self.max_steps} trains nothing; give a positive number of "
                              "optimizer steps, or -1 to let trainer.max_epochs decide.")
        if self.max_epochs <= 0 and self.max_steps <= 0:
            raise ConfigError("Set trainer.max_epochs or trainer.max_steps to a positive number.")
        if self.overfit_batches < 0 or self.profile_steps < 0:
            raise ConfigError("trainer.overfit_batches and trainer.profile_steps must be 0 or more.")
        if self.num_workers < 0:
            raise ConfigError(f"trainer.num_workers must be 0 or more, got {self.num_workers}.")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"trainer.ema_decay must be in (0, 1) (or null), got {self.ema_decay}.")


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every_n_steps: int | None = None
    """Save every N optimizer steps; null disables step checkpoints."""
    every_epoch: bool = True
    """Also save at the end of every epoch."""
    total_limit: int | None = 3
    """Keep at most this many recent checkpoints (the best one is kept in addition with ``keep_best``; one
    rotated out that holds a best evaluation's weights still needed leaves them as ``best_<step>``, not
    counted); null keeps all."""
    keep_best: bool = True
    """Never rotate out the checkpoint with the best ``early_stopping.monitor`` value."""
    save_final_model: bool = True
    """Export the trained model to ``<run folder>/model/`` at the end."""
    export: ExportChoice | None = None
    """Which weights ``model/`` gets: ``best`` (those of the evaluation with the best
    ``early_stopping.monitor``, kept whenever an evaluation improves on the best, whatever the
    checkpoint schedule: by the checkpoint of its step, else in ``checkpoints/best_<step>/``) or
    ``last`` (the final weights; nothing is kept for the export); null: best."""
    async_save: bool = True
    """Write checkpoints in the background: the loop copies the state off the device (into host buffers
    kept for the run, pinned on GPUs) and trains on while a writer thread writes, fsyncs and commits
    it; the next save, an interrupt and the end of the run wait for it. Every guarantee of a checkpoint
    stays (a crash mid-write leaves the previous one the newest complete one). Not safe where the host
    cannot hold one more copy of the weights and optimizer state: a save whose copy would take more
    than half the available host memory is written synchronously (said in the log); set false to
    always stop the loop for the write (and hold no copy)."""

    @property
    def enabled(self) -> bool:
        """Whether the run saves checkpoints at all."""
        return self.every_n_steps is not None or self.every_epoch

    def resolved_export(self) -> ExportChoice:
        return self.export if self.export is not None else ExportChoice.best

    def check(self) -> None:
        require_positive({"checkpoint.every_n_steps": self.every_n_steps, "checkpoint.total_limit": self.total_limit})


@dataclass
class EarlyStoppingConfig:
    """Stop when the monitored metric stops improving, or the loss is not finite."""

    monitor: str = "eval/accuracy"
    mode: MonitorMode = MonitorMode.max
    patience: int | None = 3
    """Evaluations without improvement before stopping; null disables metric-based stopping. The best
    evaluation is the first that reached the best value (a tie is no improvement)."""
    min_delta: float = 0.0
    """Smallest change that counts as an improvement (over the last evaluation that made one)."""
    stop_on_nan: bool = True
    """Stop at once if the training loss is NaN or infinite."""

    def check(self) -> None:
        require_positive({"early_stopping.patience": self.patience})
        if self.min_delta < 0:
            raise ConfigError(f"early_stopping.min_delta must be 0 or more, got {self.min_delta}.")


@dataclass
class LoggingConfig:
    trackers: list[Tracker] = field(default_factory=lambda: [Tracker.tensorboard])
    """Experiment trackers; wandb runs offline unless WANDB_MODE/WANDB_API_KEY say otherwise."""
    progress_bar: bool = True
    """Progress bars for training, evaluation and data preparation (main process only)."""
    print_config: bool = False
    """Print the resolved config as a tree at start (coloured on a terminal); false: one line with the
    command line's overrides, the tree in ``app.log`` and the values in ``.hydra/config.yaml``."""
    project_name: str = "app"
    """wandb's project, MLflow's experiment."""
    group: str | None = None
    """wandb's run group; null: none for a single run, the sweep folder's path for a multirun's jobs."""
    mlflow_tracking_uri: str | None = None
    """Where the mlflow tracker writes (a tracking server's URL, or a backend store such as
    ``sqlite:///path/mlflow.db``); null: ``sqlite:///<outputs>/mlflow.db``, <outputs> being the folder
    that holds both hydra.run.dir and hydra.sweep.dir (``outputs/`` by default: every run and every
    sweep job in one store; app/run_folder/layout.py)."""

    def check(self) -> None:
        for tracker in (Tracker.wandb, Tracker.mlflow):
            if tracker in self.trackers:
                require_package(tracker.value, f"logging.trackers={tracker.value}", tracker.value,
                                f"remove {tracker.value} from logging.trackers")


@dataclass
class AdapterConfig:
    """``adapter=none``: the whole model is trained (its options add their fields)."""

    kind: AdapterKind = AdapterKind.none

    def check(self) -> None:
        pass


@dataclass
class LoraAdapterConfig(AdapterConfig):
    """``adapter=lora``: peft's LoRA on the task's model. Only the low-rank matrices (and a
    classifier head, which peft trains whole) are trained; the model's own weights stay frozen."""

    kind: AdapterKind = AdapterKind.lora
    r: int = 8
    """Rank of each low-rank update."""
    alpha: float = 16.0
    """Scaling: the update is ``alpha / r * B @ A``."""
    dropout: float = 0.1
    """Dropout on the adapter's input."""
    target_modules: list[str] | None = None
    """The modules that get an adapter, by name or the end of one (peft's rule: ``[query, value]``,
    or ``[all-linear]``); each must name a module of the model. null: peft's defaults for the model
    type (BERT: query, value)."""
    merge_on_export: bool = True
    """Also export the adapter merged into the model's weights: ``model/`` then loads with plain
    ``from_pretrained``; the adapter alone is in ``model/adapter/`` either way."""

    def check(self) -> None:
        require_package("peft", "adapter=lora", "peft", "use adapter=none")
        require_positive({"adapter.r": self.r, "adapter.alpha": self.alpha})
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"adapter.dropout must be in [0, 1), got {self.dropout}.")
        if self.target_modules is not None and (not self.target_modules or not all(self.target_modules)):
            raise ConfigError("adapter.target_modules must name at least one module (or be null: peft's defaults "
                              "for the model type).")


@dataclass
class TaskConfig:
    """Base of every task schema; each task adds its own fields (see ``app/tasks``)."""

    UNUSED: ClassVar[dict[str, str]] = {}
    """Keys this task's schema inherits from another task's that the task does not use, each with what to
    do instead: a value other than the default is refused in one sentence (:meth:`check_unused`), and
    ``--help`` does not list them. A key a task lists in ``--help`` is one it reads (tests/test_task_keys.py)."""

    name: str = MISSING

    @property
    def streams_training_data(self) -> bool:
        """Whether the training split is read as a stream (``task=causal_lm task.streaming=true``): its
        length is unknown until it ends, so the run needs ``trainer.max_steps`` and takes no sampler."""
        return False

    def check(self) -> None:
        """A task's own rules (``task.dropout`` in [0, 1)...), beside its fields in its schema; the task
        also checks the config it is built with, so a config given directly is refused alike."""

    def check_unused(self) -> None:
        """``task.<key>=<value> does not apply to task=<name>: ...`` for a key of :attr:`UNUSED` given a
        value other than its default."""
        for f in dataclasses.fields(self):
            if f.name not in self.UNUSED:
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = getattr(self, f.name)
            if value != default:
                shown = value.value if isinstance(value, enum.Enum) else str(value).lower() if isinstance(value, bool) \
                    else value  # as typed: true, not Python's True
                raise ConfigError(f"task.{f.name}={shown} does not apply to task={self.name}: {self.UNUSED[f.name]}")

    def check_in_run(self, run: RunConfig) -> None:
        """A task's rules on the run's other groups (``task=dpo task.reference=base`` needs
        ``adapter=lora``), checked after every group's own; none by default."""

    def keys_scaling(self, metric: str) -> tuple[str, ...]:
        """The task's keys whose value changes the scale of ``metric`` (``task=dpo``'s ``eval/loss`` with
        ``task.beta``): a sweep over one of them ranks its jobs by numbers that do not compare. None by
        default."""
        return ()

    def comparable_metric(self) -> str | None:
        """A metric of this task that compares across every key (``task=dpo``: ``eval/rewards/accuracies``),
        for a sweep over a key that scales the others; None: none to name."""
        return None


@runtime_checkable
class PredictsTestConfig(Protocol):
    """A task schema with ``predict_test``: the task can write predictions on its unlabeled test split
    (its task object is then a :class:`app.tasks.base.PredictsTest`)."""

    predict_test: bool


@dataclass
class RunConfig:
    if TYPE_CHECKING:
        task: TaskConfig = MISSING
    else:
        # Any for OmegaConf: our task options name their schema (a TaskConfig) and stay typed; a task
        # from the user's package (task._target_) composes untyped, and app.tasks.external types it.
        task: Any = MISSING
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = MISSING
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    seed: int = 42
    resume: str | None = None
    """A run folder, its checkpoints/ folder, one checkpoint_<N>, or ``auto`` (the newest valid checkpoint
    of the folder given by hydra.run.dir, or a fresh start if it has none). With mode=eval, also an
    exported model/ folder; a run folder then means its model/ (its newest checkpoint when it has none)."""
    overwrite: bool = False
    """A new run in a hydra.run.dir that already holds a run: move the old folder aside to
    ``<folder>.replaced-<time>`` (never deleted) instead of refusing."""
    mode: RunMode = RunMode.train
    """train, or eval: evaluate the weights named by ``resume`` on the evaluation set, without training
    and without touching the run's files (the metrics go to the new run folder's eval_metrics.json)."""

    def check(self) -> None:
        """Every group's own rules, then those between groups; the hardware kind's come after, from
        its spec (``app.launching.validate``)."""
        self.trainer.check()
        self.hardware.check()
        self.checkpoint.check()
        self.early_stopping.check()
        if self.mode is RunMode.eval and self.resume in (None, "auto"):
            raise ConfigError("mode=eval needs the weights to evaluate: resume=<run folder, checkpoint or model "
                              "folder>.")
        self.optim.check()
        self.scheduler.check()
        self.logging.check()
        self.adapter.check()
        self.task.check()
        self.task.check_unused()
        self.task.check_in_run(self)
        if self.task.streams_training_data:
            self.check_streamed_training()

    def check_streamed_training(self) -> None:
        """What a training split read as a stream rules out: no length (the schedule's steps come from
        trainer.max_steps), no sampler, no loader workers (the stream's position is the process's own)."""
        t = self.trainer
        if t.max_steps <= 0:
            raise ConfigError("a streamed training split has no length until it ends, so the schedule needs "
                              "trainer.max_steps=<optimizer steps> (trainer.max_epochs, given with it, still stops "
                              "a run that reaches it first).")
        refused = {"trainer.group_by_length=true": t.group_by_length, "trainer.overfit_batches": t.overfit_batches,
                   "trainer.num_workers": t.num_workers}
        for name, value in refused.items():
            if value:
                raise ConfigError(f"{name} needs a training split with a length and random access; a streamed one "
                                  "is read in order by each process itself (leave it at its default).")

    @property
    def predicts_test(self) -> bool:
        """Whether the run ends with predictions on the task's test split (``task.predict_test=true``)."""
        return isinstance(self.task, PredictsTestConfig) and self.task.predict_test
