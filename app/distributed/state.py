"""``PartialState`` and ``AcceleratorState``: how an Accelerate script asks "how many processes, am
I the main one?" before or without an ``Accelerator``, and what the functional operations
(``gather(tensor)``, ``broadcast(...)``) use to find the process group.

The one process-wide handle. ``torch.distributed``'s process group is already process-wide; this
module keeps one reference to the backend that uses it (and to the newest ``Accelerator``, weakly),
so ``PartialState()`` and the functional operations answer for the same processes as the live
``Accelerator``. Nothing else reads it: an ``Accelerator`` owns its backend, precision, gradient
state and dataloaders, and two Accelerators in one process still share nothing.

>>> from app.distributed import PartialState
>>> state = PartialState()          # joins the launcher's process group if there is one
>>> if state.is_main_process:
...     print("downloading once")
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

from app import this_process
from app.distributed.backends.base import Backend
from app.distributed.facade.process import ProcessControl
from app.distributed.hardware.kinds import DistributedType

if TYPE_CHECKING:
    from app.distributed.accelerator import Accelerator


class _Live:
    backend: Backend | None = None
    accelerator: weakref.ReferenceType[Accelerator] | None = None
    debug: bool = False
    """Accelerate's ``state.debug``: the functional operations check shapes across processes first."""


_LIVE = _Live()


def register_accelerator(accelerator: Accelerator) -> None:
    """Called by ``Accelerator.__init__``: the newest Accelerator is what ``AcceleratorState()`` describes."""
    _LIVE.backend = accelerator.backend
    _LIVE.accelerator = weakref.ref(accelerator)


def live_backend(cpu: bool = False) -> Backend:
    """The live backend, created from the environment (as ``PartialState()`` does) if there is none."""
    if _LIVE.backend is None:
        _LIVE.backend = default_backend(cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"))
    return _LIVE.backend


def default_backend(cpu: bool) -> Backend:
    """The backend the environment asks for (the hardware kind that ``detects`` it): torchrun's
    variables mean several processes; ``cpu`` keeps off accelerators."""
    from app.config import HardwareConfig, HardwareKind
    from app.distributed.hardware import detect_spec

    world_size = this_process.world_size()
    spec = detect_spec(world_size, cpu)
    return spec.build_backend(HardwareConfig(kind=HardwareKind(spec.kind), num_processes=world_size,
                                             collective_timeout_s=600.0))


def current_backend() -> Backend | None:
    """The live backend, or None before any ``Accelerator()`` or ``PartialState()`` (nothing is created)."""
    return _LIVE.backend


def live_accelerator() -> Accelerator | None:
    return _LIVE.accelerator() if _LIVE.accelerator is not None else None


def debug_mode() -> bool:
    return _LIVE.debug or os.environ.get("ACCELERATE_DEBUG_MODE", "").lower() in ("1", "true", "yes")


class PartialState(ProcessControl):
    """The processes this one belongs to (Accelerate's ``PartialState``). Creating it joins the
    launcher's process group when there is none yet; every instance answers for the live backend."""

    _name = "PartialState"

    def __init__(self, cpu: bool = False, **kwargs: Any):
        if kwargs:
            raise TypeError(f"{self._name}() does not take {', '.join(sorted(kwargs))}: the backend is created "
                            "from the launcher's variables.")
        live_backend(cpu)

    @property
    def backend(self) -> Backend:
        if _LIVE.backend is None:
            raise AttributeError(f"`{self._name}` object has no attribute `backend`. This happens if "
                                 f"`{self._name}._reset_state()` was called and an `Accelerator` or "
                                 "`PartialState` was not reinitialized.")
        return _LIVE.backend

    @property
    def initialized(self) -> bool:
        return _LIVE.backend is not None

    @property
    def debug(self) -> bool:
        return debug_mode()

    @debug.setter
    def debug(self, value: bool) -> None:
        _LIVE.debug = bool(value)

    @property
    def num_processes_per_node(self) -> int:  # Accelerate's name for the local world size
        return self.backend.num_local_processes

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Forget the live backend (Accelerate's test helper); the process group itself stays."""
        _LIVE.backend = None
        _LIVE.accelerator = None

    def destroy_process_group(self, group: Any = None) -> None:
        """Tear down the process group if this process's backend created it."""
        if _LIVE.backend is not None:
            _LIVE.backend.shutdown()

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type.value}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")


_OWNERS: weakref.WeakKeyDictionary[AcceleratorState, weakref.ReferenceType[Accelerator]] = weakref.WeakKeyDictionary()
"""Which Accelerator a state object describes (kept outside the object, so its ``__dict__`` holds
plain values only and survives pickling)."""


class AcceleratorState(PartialState):
    """``PartialState`` plus what the live ``Accelerator`` decided (mixed precision). Created
    before any Accelerator, it describes the environment with mixed precision ``"no"``."""

    _name = "AcceleratorState"

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any):
        super().__init__(cpu, **kwargs)
        accelerator = live_accelerator()
        if accelerator is not None:
            _OWNERS[self] = weakref.ref(accelerator)
        self._mixed_precision = mixed_precision
        self._distributed_type: DistributedType | None = None

    @classmethod
    def of(cls, accelerator: Accelerator) -> AcceleratorState:
        """The state of this Accelerator (``accelerator.state``)."""
        state = cls.__new__(cls)
        _OWNERS[state] = weakref.ref(accelerator)
        state._mixed_precision = None
        state._distributed_type = None
        return state

    def _owner(self) -> Accelerator | None:
        ref = _OWNERS.get(self)
        return ref() if ref is not None else None

    @property
    def backend(self) -> Backend:
        accelerator = self._owner()
        return accelerator.backend if accelerator is not None else super().backend

    @property
    def distributed_type(self) -> DistributedType:
        return self._distributed_type or super().distributed_type

    @distributed_type.setter
    def distributed_type(self, value: DistributedType) -> None:
        """Accelerate scripts overwrite it to make their Accelerator act as another kind (its
        ``join_uneven_inputs`` reads it); it changes nothing else."""
        self._distributed_type = DistributedType(value) if value != super().distributed_type else None

    deepspeed_plugin: None = None
    """Accelerate's DeepSpeed settings: there is no DeepSpeed here (scripts test it for None)."""

    @property
    def mixed_precision(self) -> str:
        accelerator = self._owner()
        if accelerator is not None:
            return accelerator.mixed_precision
        return self._mixed_precision or "no"

    def __repr__(self) -> str:
        return super().__repr__() + f"\nMixed precision type: {self.mixed_precision}\n"


class GradientState:
    """What the data pipeline tells the gradient-accumulation logic. Each Accelerator owns its own
    (``accelerator.gradient_state``), so resetting it is a no-op; Accelerate's import path.

    Loaders being iterated form a stack (an evaluation loop may run inside a training epoch); the
    innermost one answers ``active_dataloader``, ``end_of_dataloader`` and ``remainder``.
    """

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.sync_gradients = True
        self.active: list[Any] = []
        plugin = gradient_accumulation_plugin
        self.num_steps: int = (getattr(plugin, "num_steps", None) or 1)
        self.adjust_scheduler: bool = getattr(plugin, "adjust_scheduler", True)
        self.sync_with_dataloader: bool = getattr(plugin, "sync_with_dataloader", True)
        self.sync_each_batch: bool = getattr(plugin, "sync_each_batch", False)

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active)

    @property
    def active_dataloader(self) -> Any:
        """The innermost prepared loader being iterated, or None."""
        return self.active[-1] if self.active else None

    @property
    def end_of_dataloader(self) -> bool:
        return self.active[-1].end_of_dataloader if self.active else False

    @property
    def remainder(self) -> int:
        """Real samples in the last global step of the innermost loader; -1 before its end."""
        return self.active[-1].remainder if self.active else -1

    @staticmethod
    def _reset_state() -> None:
        pass
