"""The interface of a hardware kind: everything the rest of the application asks about a
``hardware=`` option. One subclass per kind, one file each; ``registry.py`` maps the option's value
to its spec.

The base class is a single process on the CPU: a kind overrides only what differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from app.config import ConfigError, HardwareConfig, PrecisionMode, RunConfig
from app.distributed.hardware.device import CPU, DeviceOps

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend

Visible = Mapping[str, int]
"""Devices this machine shows, by torch device type (``{"cuda": 2}``); see :meth:`HardwareSpec.probe`."""
Launched = tuple[int, int] | None
"""(WORLD_SIZE, LOCAL_WORLD_SIZE) when a launcher such as torchrun started this process, else None."""


class HardwareSpec:
    """One hardware kind. Subclasses set :attr:`kind` and :attr:`devices` and override the rest as
    needed; none of the callers compares kinds."""

    kind: str = "cpu"
    """The ``hardware=`` option (a :class:`~app.config.HardwareKind` value)."""
    devices: tuple[DeviceOps, ...] = (CPU,)
    """The device types this kind may run on, preferred first (their operations become reachable
    through ``registry.device_ops``, and the backends this kind builds get them)."""
    multi_process: bool = False
    """Whether the kind runs several processes that talk through collectives (DDP, FSDP2)."""
    compiles: bool = True
    """Whether ``torch.compile`` works on this kind (``trainer.compile=true``)."""
    native_notices: tuple[str, ...] = ()
    """Lines (substrings) this kind's native runtime writes to stderr that say nothing to a user:
    ``python -m app`` keeps them in the run's log file, off the terminal (``app.console.native_stderr``)."""
    native_source: str = "native"
    """The name those lines carry in the log file."""

    @property
    def runs_hub_kernels(self) -> bool:
        """Whether transformers' Hub kernels (the ``kernels`` library) run on every device type this
        kind may use."""
        return all(ops.hub_kernels for ops in self.devices)

    # -- checks, before any process group exists ------------------------------------------------------
    def probe(self) -> Visible:
        """Count what this kind needs from the machine (cheap; no process group, no device init)."""
        return {}

    def device_type(self, visible: Visible) -> str:
        """The torch device type a run of this kind uses on a machine that shows ``visible``."""
        return self.devices[0].type

    def device_ops(self, visible: Visible) -> DeviceOps:
        """The operations of that device type (the CPU's for a type the kind does not list)."""
        wanted = self.device_type(visible)
        return next((ops for ops in self.devices if ops.type == wanted), CPU)

    def validate(self, cfg: RunConfig, visible: Visible, launched: Launched, multi_process_kinds: str) -> None:
        """Raise :class:`ConfigError` (one sentence) when ``cfg`` cannot run on this kind here.
        ``multi_process_kinds``: what a single-process kind suggests for several processes (the
        registry's ``multi_process_kinds()``; a spec knows no other kind)."""
        self.check_devices(cfg.hardware, visible)
        self.check_precision(cfg.precision.mode, visible)
        if not self.multi_process and (cfg.hardware.num_processes > 1 or cfg.hardware.num_nodes > 1):
            raise ConfigError(
                f"hardware={self.kind} runs one process; use hardware={multi_process_kinds} for "
                f"hardware.num_processes={cfg.hardware.num_processes}."
            )
        self.check_layout(cfg.hardware, visible)
        check_launcher(cfg.hardware, launched)
        if cfg.trainer.compile and not self.compiles:
            raise ConfigError(f"trainer.compile=true does not work with hardware={self.kind}; set trainer.compile=false.")

    def check_devices(self, hw: HardwareConfig, visible: Visible) -> None:
        """Whether the devices the kind needs are there."""

    def check_precision(self, mode: PrecisionMode, visible: Visible) -> None:
        """The precision must run on the device type this kind uses here (its DeviceOps say so)."""
        refusal = self.device_ops(visible).precision_refusal(mode.value)
        if refusal is not None:
            raise ConfigError(refusal)

    def check_layout(self, hw: HardwareConfig, visible: Visible) -> None:
        """The number of processes and nodes the config asks for (a single-process kind has already
        refused more than one)."""

    # -- processes --------------------------------------------------------------------------------------
    def local_workers(self, hw: HardwareConfig) -> int:
        """How many worker processes ``python -m app`` (and ``notebook_launcher``) start on this
        machine; 0: the job runs in the calling process (one process, or one process driving all of
        the host's devices)."""
        return 0

    def detects(self, world_size: int, cpu: bool) -> bool:
        """Whether an ``Accelerator()`` made without a config runs on this kind, in an environment
        where a launcher started ``world_size`` processes (1 without one); ``cpu`` is the
        Accelerator's ``cpu=True``. The registry asks the kinds in its order, first yes wins.
        ``notebook_launcher`` asks the same question (with the processes it was asked for) to
        choose the kind whose ``local_workers`` it forks."""
        return world_size == 1

    # -- objects ------------------------------------------------------------------------------------------
    def build_backend(self, hw: HardwareConfig) -> Backend:
        from app.distributed.backends.base import Backend

        return Backend(self.devices[0].local_device(0), self.devices[0])


class MultiProcessSpec(HardwareSpec):
    """A kind with one process per device (or per CPU worker) on every node, joined by collectives."""

    multi_process = True

    def check_layout(self, hw: HardwareConfig, visible: Visible) -> None:
        if hw.num_processes * hw.num_nodes < 2:
            raise ConfigError(
                f"hardware={self.kind} needs at least 2 processes; set hardware.num_processes=2 or more."
            )

    def local_workers(self, hw: HardwareConfig) -> int:
        return hw.num_processes


def check_launcher(hw: HardwareConfig, launched: Launched) -> None:
    """The config must describe the layout a launcher already started, and several nodes need one."""
    if launched is None and hw.num_nodes > 1:
        raise ConfigError(
            f"hardware.num_nodes={hw.num_nodes} needs a launcher on every node: run torchrun --nnodes "
            f"{hw.num_nodes} --nproc_per_node {hw.num_processes} --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
            "-m app ... on each."
        )
    if launched is not None:
        world, local_world = launched
        if (world, local_world) != (hw.num_processes * hw.num_nodes, hw.num_processes):
            raise ConfigError(
                f"the launcher started {world} process(es), {local_world} per node, but the config asks for "
                f"hardware.num_nodes={hw.num_nodes} x hardware.num_processes={hw.num_processes}; make them agree."
            )
