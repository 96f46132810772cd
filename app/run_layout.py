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
      checkpoints/            checkpoint_<N>/ (their own layout: app/distributed/checkpoint/store.py)
      model/                  the exported model, and export.json (which weights, from where)
      result.json             how the run ended
      eval_metrics.json       a mode=eval run's metrics
      test_predictions.tsv    task.predict_test=true
      profile/                debug=profile's traces (profile_<rank>.json)
      report.png              python -m app.report <run folder>
      .lock                   held by the run that owns the folder (app/run_folder.py)
"""

from __future__ import annotations

from pathlib import Path

HYDRA_DIR = ".hydra"
HYDRA_CONFIG, HYDRA_SETTINGS, HYDRA_OVERRIDES = "config.yaml", "hydra.yaml", "overrides.yaml"
"""The files of ``.hydra/``: the composed job config, Hydra's own config, the command line's overrides."""
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
MODEL_DIR = "model"
EXPORT_FILE = "export.json"
"""In ``model/``: which weights were exported, and from which checkpoint."""
RESULT_FILE = "result.json"
EVAL_METRICS_FILE = "eval_metrics.json"
PREDICTIONS_FILE = "test_predictions.tsv"
PROFILE_DIR = "profile"
REPORT_FILE = "report.png"
LOCK_FILE = ".lock"


def hydra_file(run_dir: Path, name: str) -> Path:
    """``<run>/.hydra/<name>`` (one of HYDRA_CONFIG, HYDRA_SETTINGS, HYDRA_OVERRIDES)."""
    return run_dir / HYDRA_DIR / name


def metrics_file(run_dir: Path) -> Path:
    return run_dir / METRICS_FILE


def result_file(run_dir: Path) -> Path:
    return run_dir / RESULT_FILE


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def model_dir(run_dir: Path) -> Path:
    return run_dir / MODEL_DIR


def tensorboard_dir(run_dir: Path) -> Path:
    return run_dir / TENSORBOARD_DIR


def profile_dir(run_dir: Path) -> Path:
    return run_dir / PROFILE_DIR

