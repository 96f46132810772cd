"""One run folder for a job that torchrun started (``torchrun --nproc_per_node=2 -m app ...``).

Every rank runs ``python -m app`` and so Hydra; left alone, each would create its own timestamped
folder (Hydra #2070/#2074). Before Hydra starts, rank 0 works out the folder Hydra would create
and publishes it in the launcher's key-value store (the c10d TCPStore torchrun already runs); every
rank then runs Hydra with ``hydra.run.dir=<that folder>``, and ranks other than 0 also with Hydra's
output (``.hydra/``) and logging switched off, so they write nothing there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from app.launching.overrides import override_key, quote

# Hydra settings that ranks other than 0 replace with "write nothing".
_RANK0_ONLY = ("hydra.output_subdir", "hydra/job_logging", "hydra/hydra_logging")
_STORE_TIMEOUT_S = 300.0


class LaunchError(RuntimeError):
    """This torchrun launch cannot get one run folder; the message says what to do."""


def argv_for_rank(argv: list[str], conf_dir: Path) -> list[str]:
    """The Hydra arguments this rank should run with; ``argv`` unchanged outside torchrun."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return argv
    if any(arg in ("-m", "--multirun") for arg in argv):
        raise LaunchError(
            "a multirun sweep cannot run inside torchrun; run python -m app -m ... with hardware=multi_cpu "
            "(or multi_gpu/fsdp), which starts the workers of each job itself."
        )
    rank = int(os.environ["RANK"])
    given = [arg.split("=", 1)[1] for arg in argv if override_key(arg) == "hydra.run.dir"]
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        run_dir = quote(_agree(rank, lambda: _planned_run_dir(argv, conf_dir)), always=True)
    elif given:
        run_dir = given[-1]
    else:
        # Without torchrun's store, rank 0 would have to host one on MASTER_PORT, the port the
        # process group binds next; instead the user names the folder.
        raise LaunchError(
            "outside torchrun's elastic agent, pass hydra.run.dir=<folder> (without ${now:...}) so every "
            "process uses the same run folder."
        )
    argv = [arg for arg in argv if override_key(arg) != "hydra.run.dir"] + [f"hydra.run.dir={run_dir}"]
    if rank == 0:
        return argv
    return [arg for arg in argv if override_key(arg) not in _RANK0_ONLY] + [
        "hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def _agree(rank: int, propose: Callable[[], str]) -> str:
    """Rank 0's proposal, as read by every rank from the launcher's store."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=_STORE_TIMEOUT_S))
    # One key per launch (and per elastic restart), so a restarted job picks a fresh folder.
    key = f"app/run_dir/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        store.set(key, propose())
    return store.get(key).decode()


def _planned_run_dir(argv: list[str], conf_dir: Path) -> str:
    """``hydra.run.dir`` as Hydra would resolve it for these overrides (``${now:...}`` included)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = [arg for arg in argv if not arg.startswith("-")]
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None, job_name="app"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            return str(OmegaConf.select(cfg, "hydra.run.dir"))
    except Exception:  # noqa: BLE001 - Hydra, run next on every rank, reports a bad override itself
        return datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")

