"""Shared fixtures: the *real* config composed through Hydra, shrunk for speed where asked."""

from __future__ import annotations

import functools
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


def launch_app(*overrides: str, run_dir: Path) -> float | None:
    """The run ``python -m app <overrides> hydra.run.dir=<run_dir>`` makes, launched in this process
    (``app.launching.launch``, what the command calls after Hydra): several processes start from the
    app's fork server, already warm after this process's first launch, not from a new interpreter.
    For tests whose claim is the run's result rather than the command line (no ``.hydra/`` nor
    ``app.log`` is written; paths in ``overrides`` are taken from this process's folder)."""
    from app.cli.configure import limits_as_given
    from app.launching.launch import launch

    cfg = compose_config(*overrides)
    limits_as_given(cfg, overrides)  # what the command line does after composing: trainer.max_steps alone decides
    return launch(cfg, run_dir)


@pytest.fixture
def compose_cfg():
    return compose_config


@pytest.fixture(scope="session")
def text_model(tmp_path_factory) -> Path:
    """A tiny BERT whose vocabulary covers tests/helpers/text_data.py's generated texts."""
    from tests.helpers.text_data import vocabulary_text
    from tests.helpers.tiny_bert import make_tiny_bert

    return make_tiny_bert(tmp_path_factory.mktemp("text_bert"), vocabulary_text())


# -- every test on the same threads -----------------------------------------------------------------------


def worker_threads(config: pytest.Config) -> int:
    """torch's intra-op threads for a test: in an xdist worker its share of the cores (the app's rule for
    processes sharing a machine), else torch's default as the session started."""
    from app.this_process import available_cores

    workers = getattr(config, "workerinput", {}).get("workercount")
    return max(1, available_cores() // int(workers)) if workers else default_threads()


@functools.cache
def default_threads() -> int:
    import torch

    return torch.get_num_threads()


def use_worker_threads(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(worker_threads(config))


@pytest.fixture(autouse=True, scope="module")
def module_threads(request: pytest.FixtureRequest) -> None:
    """A module's shared fixtures start on the worker's threads: an in-process run sets its own and keeps
    them (app/engine/threads.py), and float results must not depend on which tests ran before."""
    use_worker_threads(request.config)


@pytest.fixture(autouse=True)
def test_threads(request: pytest.FixtureRequest) -> None:
    """So does each test."""
    use_worker_threads(request.config)


# -- the suite on every core ------------------------------------------------------------------------------


EVERYDAY = "not slow"
"""What ``python -m pytest -q`` runs when no ``-m`` is given: every test but the long end-to-end ones
(``slow``: the kill-and-resume drills on two processes, the SLURM cluster, sweeps of multi-process
jobs), which ``python -m pytest -q -m slow`` runs and ``.ci/run`` runs right after."""


def whole_suite(config: pytest.Config) -> bool:
    """Whether the session runs the suite (no arguments, or folders of tests) rather than named files or tests."""
    named = config.args_source == pytest.Config.ArgsSource.ARGS
    return not named or all(Path(arg).is_dir() for arg in config.args)


def suite_workers(config: pytest.Config) -> int:
    """How many pytest-xdist workers run a whole-suite (or marker-selected) session: one per core this
    process may use. A session naming files or tests (``pytest tests/test_foo.py``) stays in one process,
    as does one with ``-s`` or ``--pdb`` (their output and prompts are the terminal's)."""
    if not whole_suite(config):
        return 0
    if config.getoption("capture") == "no" or config.getoption("usepdb"):
        return 0
    return len(os.sched_getaffinity(0))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``python -m pytest -q`` runs the suite on one pytest-xdist worker per core (tests grouped with
    ``xdist_group`` run on one worker, in order); ``-n N`` chooses, ``-n 0`` or ``-p no:xdist`` runs in
    one process, and so does a session that names files or tests."""
    if hasattr(config, "workerinput"):  # a worker: it runs what it is sent, and selects as the session does
        config.option.markexpr = config.workerinput.get("markexpr", config.option.markexpr)
        return
    if whole_suite(config) and not config.option.markexpr:
        config.option.markexpr = EVERYDAY
    if not config.pluginmanager.hasplugin("xdist") or config.getoption("numprocesses") is not None:
        return
    config.option.numprocesses = suite_workers(config)
    if config.option.numprocesses and config.getoption("dist") == "no":
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """An xdist worker parses the command line again: it is handed the session's marker selection."""
    node.workerinput["markexpr"] = node.config.option.markexpr


def distributed(config: pytest.Config) -> bool:
    """Whether this session hands its tests to pytest-xdist workers (in the controller and the workers)."""
    return hasattr(config, "workerinput") or config.getoption("dist", "no") != "no"


# A session-scoped fixture a module defines is its own too (test_slurm.py's cluster: two workers starting a cluster
# each would hand the same job ids, and so the same MASTER_PORT, to two jobs at once).
SHARED_SCOPES = ("session", "module", "class", "package")


def shares_a_fixture_of_its_module(item: pytest.Item) -> bool:
    """Whether the test uses a module- (or class-) scoped fixture that its own module defines or imports:
    a trained run, a saved model, built once for the module's tests."""
    module = item.getparent(pytest.Module)
    defined = item._fixtureinfo.name2fixturedefs  # type: ignore[attr-defined]
    return module is not None and any(
        definitions[-1].scope in SHARED_SCOPES and definitions[-1].baseid == module.nodeid
        for definitions in defined.values())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """When the session is spread over xdist workers: the tests of a module that share its module-scoped
    fixtures go to one worker (``xdist_group``: the fixture is built once, not once per worker), and the
    long tests (``slow``, ``multiprocess``) go first, so that the workers end together rather than one
    finishing a long test while the others idle."""
    if not distributed(config):
        return
    for item in items:
        if shares_a_fixture_of_its_module(item) and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.getparent(pytest.Module).nodeid))
    items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in ("slow", "multiprocess")))


def pytest_report_header(config: pytest.Config) -> str | None:
    if hasattr(config, "workerinput") or config.option.markexpr != EVERYDAY:
        return None
    return ("the everyday suite: every test but the slow end-to-end ones, which `python -m pytest -q -m slow` runs "
            "(.ci/run runs both)")


# -- a busy machine, on request --------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--busy-loops", type=int, default=0, metavar="N",
        help="keep N busy processes (one Python loop each, at normal priority) running beside the tests for "
             "the whole session: the load a test that races the machine fails under (the stability runs "
             "of the signal and multi-process tests: -m 'signals or multiprocess' --busy-loops 2)")


BUSY_LOOPS: list[subprocess.Popen] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    """``--busy-loops N``: N processes spinning until the session ends (none by default), started once by
    the process that runs the session (not once per xdist worker)."""
    if not hasattr(session.config, "workerinput"):
        BUSY_LOOPS.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"])
                          for _ in range(session.config.getoption("--busy-loops")))


def pytest_sessionfinish(session: pytest.Session) -> None:
    while BUSY_LOOPS:
        loop = BUSY_LOOPS.pop()
        loop.kill()
        loop.wait()
