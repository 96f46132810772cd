"""Launch rules without starting workers: the config must match the process layout, and under
torchrun every rank gets the same run folder while only rank 0 keeps Hydra's output and logs."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import torch.distributed as dist

from app.cli.argv import LaunchError, argv_for_rank
from app.config import ConfigError
from app.launching.validate import validate
from app.workers.elastic import free_port
from tests.conftest import CONF_DIR, compose_config


@pytest.mark.parametrize(
    ("overrides", "launched", "message"),
    [
        (["hardware=multi_cpu", "hardware.num_processes=1"], None, "needs at least 2 processes"),
        (["hardware=fsdp", "hardware.num_processes=1"], None, "needs at least 2 processes"),
        (["hardware=cpu", "hardware.num_processes=2"], None, "runs one process"),
        (["hardware=multi_gpu"], None, "needs a CUDA GPU"),
        (["hardware=multi_cpu", "hardware.num_nodes=2"], None, "needs a launcher on every node"),
        (["hardware=cpu"], (2, 2), "the launcher started 2 process(es)"),
        (["hardware=multi_cpu", "hardware.num_processes=2"], (4, 2), "hardware.num_nodes=1 x hardware.num_processes=2"),
        (["hardware=multi_cpu", "hardware.num_processes=2", "hardware.num_nodes=2"], (4, 1), "1 per node"),
    ],
)
def test_layout_rules_fail_with_one_sentence(overrides: list[str], launched: tuple[int, int] | None,
                                             message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose_config(*overrides), visible={"cuda": 0}, launched=launched)


@pytest.mark.parametrize(
    ("overrides", "launched"),
    [
        (["hardware=multi_cpu", "hardware.num_processes=2"], None),
        (["hardware=multi_cpu", "hardware.num_processes=2"], (2, 2)),  # torchrun --nproc_per_node 2
        (["hardware=multi_cpu", "hardware.num_processes=1", "hardware.num_nodes=2"], (2, 1)),  # --nnodes 2
        (["hardware=fsdp", "hardware.num_processes=2"], None),
    ],
)
def test_valid_layouts_pass(overrides: list[str], launched: tuple[int, int] | None) -> None:
    validate(compose_config(*overrides), visible={"cuda": 0}, launched=launched)


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch):
    """This process as one rank of a 2-process torchrun job, with the agent's store hosted here."""
    port = free_port()
    store = dist.TCPStore("localhost", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    for name, value in {"WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": str(port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "t1",
                        "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    return store


def test_outside_torchrun_the_arguments_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert argv_for_rank(["a=1", "-m"], CONF_DIR) == ["a=1", "-m"]


def test_rank0_publishes_the_folder_hydra_would_create(torchrun_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    argv = argv_for_rank(["trainer.max_epochs=1", "hydra.run.dir=runs/${now:%Y}/x"], CONF_DIR)
    published = torchrun_env.get("app/run_dir/t1/0").decode()
    assert re.fullmatch(r"runs/\d{4}/x", published)
    assert argv == ["trainer.max_epochs=1", f"hydra.run.dir='{published}'"]
    # Without an override, the default pattern of conf/config.yaml is resolved once.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t2")
    argv_for_rank([], CONF_DIR)
    assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", torchrun_env.get("app/run_dir/t2/0").decode())


def test_other_ranks_use_rank0s_folder_and_write_nothing(torchrun_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    torchrun_env.set("app/run_dir/t1/0", "outputs/it's here")
    argv = argv_for_rank(["seed=3", "hydra.run.dir=mine", "hydra/job_logging=default"], CONF_DIR)
    assert argv == ["seed=3", "hydra.run.dir='outputs/it\\'s here'", "hydra.output_subdir=null",
                    "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def test_multirun_inside_torchrun_is_refused(torchrun_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(LaunchError, match="multirun sweep cannot run inside torchrun"):
        argv_for_rank(["-m", "seed=1,2"], CONF_DIR)


def test_without_the_agent_store_the_folder_must_be_named(torchrun_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with pytest.raises(LaunchError, match="pass hydra.run.dir"):
        argv_for_rank(["seed=3"], CONF_DIR)
    assert argv_for_rank(["hydra.run.dir=/shared/run1"], CONF_DIR)[:1] == ["hydra.run.dir=/shared/run1"]
