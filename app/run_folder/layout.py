"""The run folder's layout: the one place that names what a run writes into its folder, and the small
functions that build those paths. Whoever writes or reads a run folder asks here (the engine, the
runtime's trackers and checkpoints, the launchers, the report, the sweeps, ``mode=eval``), so they
agree by construction.

Torch-free and importing nothing from ``app``: the launcher and the report read it before any heavy import.

::

    <run folder>/
      .hydra/                 Hydra's record: config.yaml, hydra.yaml, overrides.yaml
      app.log                 the run's log, named by Hydra's job logging (<hydra.job.name>.log; conf/config.yaml)
      metrics.jsonl           one JSON object per logged event
      tensorboard/            the same scalars as TensorBoard events
      checkpoints/            checkpoint_<N>/, each complete once its manifest.json is written (the rest of
                              its layout: app/distributed/checkpoint/store.py)
      model/                  the exported model, export.json (which weights, from where), README.md (its
                              model card) and, with adapter=lora, adapter/ (peft's adapter files)
      result.json             how the run ended
      skipped_rows.jsonl      the rows of the data a run left out, each with its file, place and reason
                              (task.bad_rows=skip)
      samples/                step_<N>.jsonl: what the model generated at the evaluation of step N (task=sft's
                              task.sample_prompts)
      completions.jsonl       task=grpo: every completion generated while training, with its rewards and
                              advantage (one line each)
      eval_metrics.json       a mode=eval run's metrics
      test_predictions.tsv    task.predict_test=true
      profile/                debug=profile's traces (profile_<rank>.json)
      report.png              python -m app.report <run folder>
      .lock                   held by the run that owns the folder (app/run_folder/claims.py)

Beside the run folders, ``<outputs>/mlflow.db``: logging.trackers=[mlflow]'s default store (:func:`mlflow_store`).
"""

from __future__ import annotations

import os
from pathlib import Path

HYDRA_DIR = ".hydra"
HYDRA_CONFIG, HYDRA_SETTINGS, HYDRA_OVERRIDES = "config.yaml", "hydra.yaml", "overrides.yaml"
"""The files of ``.hydra/``: the composed job config, Hydra's own config, the command line's overrides."""
HYDRA_FILES = (HYDRA_CONFIG, HYDRA_SETTINGS, HYDRA_OVERRIDES)
LOG_FILE = "app.log"
"""Hydra's job log, ``<hydra.job.name>.log`` (conf/config.yaml names the job ``app``)."""
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "checkpoint_"
"""``checkpoints/checkpoint_<N>``: N numbers the saves."""
MANIFEST_FILE = "manifest.json"
"""In a checkpoint: written last, it makes the folder a checkpoint (app/distributed/checkpoint/store.py)."""
MODEL_DIR = "model"
EXPORT_FILE = "export.json"
"""In ``model/``: which weights were exported, and from which checkpoint."""
MODEL_CARD_FILE = "README.md"
"""In ``model/``: the model card (app/engine/model_card.py)."""
ADAPTER_DIR = "adapter"
"""In ``model/``: a peft adapter's own files (adapter_config.json, adapter_model.safetensors)."""
MLFLOW_DB = "mlflow.db"
RESULT_FILE = "result.json"
EVAL_METRICS_FILE = "eval_metrics.json"
PREDICTIONS_FILE = "test_predictions.tsv"
PROFILE_DIR = "profile"
REPORT_FILE = "report.png"
LOCK_FILE = ".lock"
SAMPLES_DIR = "samples"
SKIPPED_ROWS_FILE = "skipped_rows.jsonl"
COMPLETIONS_FILE = "completions.jsonl"


def hydra_file(run_dir: Path, name: str) -> Path:
    """``<run>/.hydra/<name>`` (one of HYDRA_CONFIG, HYDRA_SETTINGS, HYDRA_OVERRIDES)."""
    return run_dir / HYDRA_DIR / name


def log_file(run_dir: Path) -> Path:
    return run_dir / LOG_FILE


def samples_file(run_dir: Path, step: int) -> Path:
    """``<run>/samples/step_<step>.jsonl``: the generations of the evaluation at ``step``."""
    return run_dir / SAMPLES_DIR / f"step_{step}.jsonl"


def completions_file(run_dir: Path) -> Path:
    """``<run>/completions.jsonl``: task=grpo's completions (step, prompt, completion, rewards, advantage)."""
    return run_dir / COMPLETIONS_FILE


def metrics_file(run_dir: Path) -> Path:
    return run_dir / METRICS_FILE


def result_file(run_dir: Path) -> Path:
    return run_dir / RESULT_FILE


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def checkpoint_name(number: int) -> str:
    """The folder name of save number ``number`` in ``checkpoints/``."""
    return f"{CHECKPOINT_PREFIX}{number}"


def model_dir(run_dir: Path) -> Path:
    return run_dir / MODEL_DIR


def tensorboard_dir(run_dir: Path) -> Path:
    return run_dir / TENSORBOARD_DIR


def profile_dir(run_dir: Path) -> Path:
    return run_dir / PROFILE_DIR


def adapter_dir(model_folder: Path) -> Path:
    return model_folder / ADAPTER_DIR


def mlflow_store(run_folder: Path, hydra_run_dir: Path, hydra_sweep_dir: Path) -> str:
    """The default MLflow store, ``sqlite:///<outputs>/mlflow.db``: <outputs> is the deepest folder that
    holds both ``hydra.run.dir`` and ``hydra.sweep.dir`` (``outputs/`` with conf/config.yaml's
    ``outputs/<date>/<time>`` and ``outputs/multirun/<date>/<time>``), so single runs and every sweep's
    jobs land in one store, side by side. When the two share nothing below the filesystem's root:
    the folder that holds ``run_folder`` (a sweep job's: its sweep folder)."""
    common = Path(os.path.commonpath([hydra_run_dir.absolute(), hydra_sweep_dir.absolute()]))
    outputs = common if common != Path(common.anchor) else run_folder.absolute().parent
    return f"sqlite:///{outputs / MLFLOW_DB}"
