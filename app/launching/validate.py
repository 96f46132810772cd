"""Every rule of the run config, before any process group exists: each group's own (``RunConfig.check``,
``app/config.py``; a task's in its schema), then the hardware kind's (its spec, in
``app/distributed/hardware/``). Here, above the three, so that ``app.config`` imports none of them;
called by the launch (``launch.py``) in the process that starts the job, with the layout torchrun gave
it. Torch-free until the group rules have passed: a config they refuse answers before torch is
imported (``bench/startup.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from app.config import RunConfig


def validate(cfg: RunConfig, visible: Mapping[str, int] | None = None,
             launched: tuple[int, int] | None = None) -> None:
    """Every rule of the run config; raises ConfigError with one sentence. Runs before any process
    group exists.

    First each group's own rules (``cfg.check()``: no torch needed), then the hardware kind's spec
    checks the devices, processes and precision: against ``visible`` (devices by torch device type; by
    default the spec counts what this machine shows) and ``launched``, (WORLD_SIZE, LOCAL_WORLD_SIZE)
    when torchrun already started the processes (the config must then describe the same layout).
    """
    cfg.check()
    # Imported here: the hardware registry imports torch, which a config refused above must not wait for.
    from app.distributed.hardware import hardware_spec, multi_process_kinds

    spec = hardware_spec(cfg.hardware.kind)
    spec.validate(cfg, spec.probe() if visible is None else visible, launched, multi_process_kinds())
