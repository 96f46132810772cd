"""Our implementation of the Accelerator API (names and semantics as documented by Hugging Face
Accelerate), on torch.distributed, DDP, FSDP2 and torch.amp."""

from app.distributed.accelerator import Accelerator
from app.distributed.backend import Backend
from app.distributed.launchers import notebook_launcher
from app.distributed.length_grouping import LengthGroupedSampler
from app.distributed.precision import Precision, build_precision

__all__ = ["Accelerator", "Backend", "LengthGroupedSampler", "Precision", "build_precision", "notebook_launcher"]
