"""Shared fixtures: the *real* config composed through Hydra, shrunk for speed where asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from app.cli.configure import register_configs, to_run_config
from app.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
SHARED_DATA = REPO.parent / "shared" / "data"

register_configs()


def compose_config(*overrides: str) -> RunConfig:
    """Compose conf/config.yaml with overrides, exactly as ``python -m app`` does."""
    return compose_many([list(overrides)])[0]


def compose_many(override_lists: list[list[str]]) -> list[RunConfig]:
    """Compose several configs under one Hydra initialisation (much faster than one each), turned into
    dataclasses as ``python -m app`` does (a task from a user's package into its own schema)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return [to_run_config(compose(config_name="config", overrides=o)) for o in override_lists]


def run_app(*args: str, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None,
            check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``python -m app`` in a subprocess, as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "WANDB_MODE": "offline", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "app", *args], cwd=cwd, env=full_env, capture_output=True, check=False,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"python -m app {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture
def compose_cfg():
    return compose_config


@pytest.fixture(scope="session")
def text_model(tmp_path_factory) -> Path:
    """A tiny BERT whose vocabulary covers tests/helpers/text_data.py's generated texts."""
    from tests.helpers.text_data import vocabulary_text
    from tests.helpers.tiny_bert import make_tiny_bert

    return make_tiny_bert(tmp_path_factory.mktemp("text_bert"), vocabulary_text())


# -- a busy machine, on request --------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--busy-loops", type=int, default=0, metavar="N",
        help="keep N busy processes (one Python loop each, at normal priority) running beside the tests for "
             "the whole session: the load a test that races the machine fails under (the stability runs "
             "of the signal and multi-process tests: -m 'signals or multiprocess' --busy-loops 2)")


@pytest.fixture(scope="session", autouse=True)
def busy_machine(request: pytest.FixtureRequest):
    """``--busy-loops N``: N processes spinning until the session ends (none by default)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(request.config.getoption("--busy-loops"))]
    yield len(loops)
    for loop in loops:
        loop.kill()
        loop.wait()
