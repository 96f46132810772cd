"""Typed run configuration: one dataclass per Hydra config group.

Every YAML under ``conf/`` names its schema first in ``defaults`` so a typo key, a wrong type or an
unknown enum value is rejected by Hydra when the config is composed, before anything trains.
``OmegaConf.to_object`` turns the composed config into these dataclasses once, in ``app.__main__``;
nothing below the entry point reads a ``DictConfig``.

Rules that span several fields (``total_limit < 1``...) live in :func:`validate` and fail with one
sentence as :class:`ConfigError`; the rules of a hardware kind (devices, processes, precisions) are
its spec's, in ``app/distributed/hardware/``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class ConfigError(ValueError):
    """A run configuration that cannot work; the message is one sentence for the user."""


class HardwareKind(enum.Enum):
    """The ``hardware=`` options; each value has its spec in ``app/distributed/hardware/registry.py``."""

    cpu = "cpu"
    gpu = "gpu"
    multi_cpu = "multi_cpu"
    multi_gpu = "multi_gpu"
    fsdp = "fsdp"
    tpu = "tpu"


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


@dataclass
class TrainerConfig:
    """The fixed training loop's knobs."""

    max_epochs: int = 10
    max_steps: int = -1
    """Optimizer steps to run; -1 means ``max_epochs`` decides."""
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


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every_n_steps: int | None = None
    """Save every N optimizer steps; null disables step checkpoints."""
    every_epoch: bool = True
    """Also save at the end of every epoch."""
    total_limit: int | None = 3
    """Keep at most this many recent checkpoints (the best one is kept in addition); null keeps all."""
    keep_best: bool = True
    """Never rotate out the checkpoint with the best ``early_stopping.monitor`` value."""
    save_final_model: bool = True
    """Export the trained model to ``<run folder>/model/`` at the end."""
    export: ExportChoice | None = None
    """Which weights ``model/`` gets: ``best`` (the evaluation with the best ``early_stopping.monitor``,
    from its checkpoint) or ``last`` (the final weights); null: best when checkpoints are saved and the
    best is kept (keep_best), else last."""

    @property
    def enabled(self) -> bool:
        """Whether the run saves checkpoints at all."""
        return self.every_n_steps is not None or self.every_epoch

    def resolved_export(self) -> ExportChoice:
        if self.export is not None:
            return self.export
        keeps_best = self.keep_best or self.total_limit is None
        return ExportChoice.best if self.enabled and keeps_best else ExportChoice.last


@dataclass
class EarlyStoppingConfig:
    """Stop when the monitored metric stops improving, or the loss is not finite."""

    monitor: str = "eval/accuracy"
    mode: MonitorMode = MonitorMode.max
    patience: int | None = 3
    """Evaluations without improvement before stopping; null disables metric-based stopping."""
    min_delta: float = 0.0
    """Smallest change that counts as an improvement."""
    stop_on_nan: bool = True
    """Stop at once if the training loss is NaN or infinite."""


@dataclass
class LoggingConfig:
    trackers: list[Tracker] = field(default_factory=lambda: [Tracker.tensorboard])
    """Experiment trackers; wandb runs offline unless WANDB_MODE/WANDB_API_KEY say otherwise."""
    progress_bar: bool = True
    """Progress bars for training, evaluation and data preparation (main process only)."""
    print_config: bool = True
    """Print the resolved config as a tree at start (coloured on a terminal)."""
    project_name: str = "app"
    group: str | None = None
    """wandb's run group; null: none for a single run, the sweep folder's path for a multirun's jobs."""


@dataclass
class TaskConfig:
    """Base of every task schema; each task adds its own fields (see ``app/tasks``)."""

    name: str = MISSING


@dataclass
class RunConfig:
    task: Any = MISSING
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: Any = MISSING
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 42
    resume: str | None = None
    """A run folder, its checkpoints/ folder, one checkpoint_<N>, or ``auto`` (the newest valid checkpoint
    of the folder given by hydra.run.dir, or a fresh start if it has none). With mode=eval, also an
    exported model/ folder."""
    overwrite: bool = False
    """A new run in a hydra.run.dir that already holds a run: move the old folder aside to
    ``<folder>.replaced-<time>`` (never deleted) instead of refusing."""
    mode: RunMode = RunMode.train
    """train, or eval: evaluate the weights named by ``resume`` on the evaluation set, without training
    and without touching the run's files (the metrics go to the new run folder's eval_metrics.json)."""


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore; YAML options extend them by name."""
    from app.tasks import TASK_SCHEMAS

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="hardware", name="hardware_schema", node=HardwareConfig)
    cs.store(group="precision", name="precision_schema", node=PrecisionConfig)
    cs.store(group="optim", name="adamw_schema", node=AdamWConfig)
    cs.store(group="optim", name="sgd_schema", node=SGDConfig)
    cs.store(group="scheduler", name="scheduler_schema", node=SchedulerConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="checkpoint", name="checkpoint_schema", node=CheckpointConfig)
    cs.store(group="early_stopping", name="early_stopping_schema", node=EarlyStoppingConfig)
    cs.store(group="logging", name="logging_schema", node=LoggingConfig)
    for name, schema in TASK_SCHEMAS.items():
        cs.store(group="task", name=f"{name}_schema", node=schema)
    register_grid_sweeper(cs)
    OmegaConf.register_new_resolver("app.parallel_jobs", parallel_jobs, replace=True)


def parallel_jobs(processes_per_job: int) -> int:
    """How many jobs of ``processes_per_job`` processes this machine's cores run at once (>= 1)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(processes_per_job)))


def register_grid_sweeper(cs: ConfigStore) -> None:
    """``hydra/sweeper=basic`` (Hydra's default) becomes Hydra's grid sweeper that, with resume=auto,
    reads a sweep's finished jobs back instead of running them again (hydra_plugins/app_sweepers).

    Stored under Hydra's own name: an ``override hydra/sweeper`` in conf/config.yaml would also win
    over the one in hparams_search/*.yaml (Hydra keeps a group's first override). After Hydra's plugin
    scan, which stores Hydra's own ``basic`` again each time it runs (once per process).
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeperConf
    from hydra.core.plugins import Plugins

    Plugins.instance()

    @dataclass
    class ResumableBasicSweeperConf(BasicSweeperConf):
        _target_: str = "hydra_plugins.app_sweepers.resumable.ResumableBasicSweeper"

    cs.store(group="hydra/sweeper", name="basic", node=ResumableBasicSweeperConf, provider="app")


def validate(cfg: RunConfig, visible: Mapping[str, int] | None = None,
             launched: tuple[int, int] | None = None) -> None:
    """Cross-field rules; raises ConfigError with one sentence. Runs before any process group exists.

    The hardware kind's spec checks the devices, processes and precision: against ``visible``
    (devices by torch device type; by default the spec counts what this machine shows) and
    ``launched``, (WORLD_SIZE, LOCAL_WORLD_SIZE) when torchrun already started the processes (the
    config must then describe the same layout).
    """
    t, hw, ckpt = cfg.trainer, cfg.hardware, cfg.checkpoint
    positive = {
        "trainer.batch_size": t.batch_size,
        "trainer.gradient_accumulation_steps": t.gradient_accumulation_steps,
        "trainer.log_every_n_steps": t.log_every_n_steps,
        "hardware.num_processes": hw.num_processes,
        "hardware.num_nodes": hw.num_nodes,
    }
    optional_positive = {
        "trainer.eval_batch_size": t.eval_batch_size,
        "trainer.eval_every_n_steps": t.eval_every_n_steps,
        "trainer.limit_eval_batches": t.limit_eval_batches,
        "trainer.max_grad_norm": t.max_grad_norm,
        "checkpoint.every_n_steps": ckpt.every_n_steps,
        "checkpoint.total_limit": ckpt.total_limit,
        "early_stopping.patience": cfg.early_stopping.patience,
    }
    for key, value in {**positive, **{k: v for k, v in optional_positive.items() if v is not None}}.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}.")
    if t.max_steps == 0 or t.max_steps < -1:
        raise ConfigError(f"trainer.max_steps={t.max_steps} trains nothing; give a positive number of optimizer "
                          "steps, or -1 to let trainer.max_epochs decide.")
    if t.max_epochs <= 0 and t.max_steps <= 0:
        raise ConfigError("Set trainer.max_epochs or trainer.max_steps to a positive number.")
    if cfg.mode is RunMode.eval and cfg.resume in (None, "auto"):
        raise ConfigError("mode=eval needs the weights to evaluate: resume=<run folder, checkpoint or model folder>.")
    if t.overfit_batches < 0 or t.profile_steps < 0:
        raise ConfigError("trainer.overfit_batches and trainer.profile_steps must be 0 or more.")
    if t.num_workers < 0:
        raise ConfigError(f"trainer.num_workers must be 0 or more, got {t.num_workers}.")
    lr = getattr(cfg.optim, "lr", None)
    if lr is None or lr <= 0:
        raise ConfigError(f"optim.lr must be a positive number, got {lr}.")
    if getattr(cfg.optim, "weight_decay", 0.0) < 0:
        raise ConfigError(f"optim.weight_decay must be 0 or more, got {cfg.optim.weight_decay}.")
    layer_decay = getattr(cfg.optim, "layer_decay", None)
    if layer_decay is not None and not 0.0 < layer_decay <= 1.0:
        raise ConfigError(f"optim.layer_decay must be in (0, 1] (or null), got {layer_decay}.")
    for pattern in getattr(cfg.optim, "freeze", None) or []:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"optim.freeze has {pattern!r}, which is not a regular expression ({e}).") from None
    if t.ema_decay is not None and not 0.0 < t.ema_decay < 1.0:
        raise ConfigError(f"trainer.ema_decay must be in (0, 1) (or null), got {t.ema_decay}.")
    if not 0.0 <= cfg.scheduler.warmup_ratio < 1.0 or cfg.scheduler.warmup_steps < 0:
        raise ConfigError("scheduler.warmup_ratio must be in [0, 1) and scheduler.warmup_steps 0 or more.")
    if cfg.early_stopping.min_delta < 0:
        raise ConfigError(f"early_stopping.min_delta must be 0 or more, got {cfg.early_stopping.min_delta}.")
    if ckpt.export is ExportChoice.best and not (ckpt.enabled and (ckpt.keep_best or ckpt.total_limit is None)):
        raise ConfigError("checkpoint.export=best needs the best checkpoint kept: set checkpoint.every_epoch=true or "
                          "checkpoint.every_n_steps, with checkpoint.keep_best=true (or export=last).")
    if hw.collective_timeout_s <= 0:
        raise ConfigError("hardware.collective_timeout_s must be positive.")

    from app.distributed.hardware import hardware_spec

    spec = hardware_spec(hw.kind)
    spec.validate(cfg, spec.probe() if visible is None else visible, launched)
