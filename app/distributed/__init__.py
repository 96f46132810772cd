"""Our implementation of the Accelerator API (names and semantics as documented by Hugging Face
Accelerate), on torch.distributed, DDP, FSDP2 and torch.amp.

An Accelerate script changes its imports only: ``accelerate`` → ``app.distributed``,
``accelerate.utils`` → ``app.distributed.utils`` (see docs/accelerate.md)."""

from app.distributed.accelerator import Accelerator
from app.distributed.backends.base import Backend
from app.distributed.configuration import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from app.distributed.data.length_grouping import LengthGroupedSampler
from app.distributed.data_loader import SeedableRandomSampler
from app.distributed.hardware.kinds import DistributedType
from app.distributed.launchers import notebook_launcher
from app.distributed.precision import Precision, build_precision
from app.distributed.state import AcceleratorState, GradientState, PartialState
from app.distributed.utils import find_executable_batch_size

__all__ = ["Accelerator", "AcceleratorState", "Backend", "DataLoaderConfiguration", "DistributedDataParallelKwargs",
           "DistributedType", "GradientAccumulationPlugin", "GradientState", "LengthGroupedSampler", "PartialState",
           "Precision", "ProjectConfiguration", "SeedableRandomSampler", "build_precision",
           "find_executable_batch_size", "notebook_launcher"]
