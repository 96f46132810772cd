"""Entry point: ``python -m app [overrides]``.

Hydra composes and type-checks the config (a typo key, a wrong type or an unknown option stops here
with Hydra's message); ``OmegaConf.to_object`` turns it into dataclasses once; cross-field rules
run next; then the job runs in this process or, for multi-process hardware, in workers started by
torch's elastic launcher.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app.config import ConfigError, RunConfig, register_configs

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
log = logging.getLogger("app")

register_configs()


def fail(message: str, exit_code: int = 2) -> None:
    """One sentence on stderr (and in the run's log), then a non-zero exit (2: bad input)."""
    log.error(message)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> float | None:
    try:
        cfg: RunConfig = OmegaConf.to_object(dict_cfg)  # type: ignore[assignment]
    except Exception as err:  # noqa: BLE001 - OmegaConf reports missing values and bad interpolations
        fail(f"invalid configuration: {err}".splitlines()[0])
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if os.environ.get("RANK", "0") == "0":
        # Said at once: the rest of start-up (imports, data) can take seconds.
        log.info("run folder %s", run_dir)
    if hydra_cfg.mode is RunMode.MULTIRUN and cfg.logging.group is None:
        cfg.logging.group = str(hydra_cfg.sweep.dir)  # wandb shows a sweep's jobs as one group
    from app.launch import launch
    from app.worker_errors import WorkerFailed

    try:
        return launch(cfg, run_dir)
    except ConfigError as err:
        fail(str(err))
    except WorkerFailed as err:
        # The launcher has already printed the rank's traceback; the last line names rank and error.
        fail(str(err), exit_code=1)
    return None


if __name__ == "__main__":
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        from app.help import app_help

        print(app_help(CONF_DIR), end="")
        sys.exit(0)
    from app.engine.checkpoint_resume import argv_for_resume
    from app.launch import adopt_slurm_layout
    from app.torchrun import LaunchError, argv_for_rank

    try:
        # resume=<path> continues in the original run folder: decided before Hydra creates a new one.
        sys.argv[1:] = argv_for_resume(sys.argv[1:])
    except ConfigError as err:
        fail(str(err))
    if not any(arg in ("-m", "--multirun") for arg in sys.argv[1:]):
        adopt_slurm_layout()  # srun -n N python -m app ...: each SLURM task is one rank
    try:
        # Inside torchrun, every rank must agree on one run folder before Hydra creates any.
        sys.argv[1:] = argv_for_rank(sys.argv[1:], CONF_DIR)
    except LaunchError as err:
        fail(str(err))
    main()
