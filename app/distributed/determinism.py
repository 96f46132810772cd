"""``trainer.deterministic=true``: torch's deterministic algorithms and the settings they need.

cuBLAS needs a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when the CUDA context starts, so
it is set before anything runs on the device); cuDNN must not pick kernels by timing them
(``benchmark``) and must use its deterministic ones. An op with no deterministic implementation then
raises instead of silently varying between runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Deterministic algorithms inside the block (a no-op when not ``enabled``); restored after."""
    if not enabled:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[1], saved[2]
        if saved[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
