"""Hardware kinds: one spec object per ``hardware=`` option (``registry.py``), the device-type
operations they use (``device.py``, ``cuda.py``). Only this package and the backend implementations
(``app/distributed/backends/``) name device types or collective libraries."""

from app.distributed.hardware.device import DeviceOps
from app.distributed.hardware.registry import (
                                               SPECS,
                                               build_backend,
                                               detect_spec,
                                               device_ops,
                                               hardware_spec,
                                               multi_process_kinds,
)
from app.distributed.hardware.spec import HardwareSpec, MultiProcessSpec, Visible

__all__ = ["SPECS", "DeviceOps", "HardwareSpec", "MultiProcessSpec", "Visible", "build_backend", "detect_spec",
           "device_ops", "hardware_spec", "multi_process_kinds"]
