"""Apply a tensor operation to every tensor inside nested lists, tuples and dicts (Accelerate keeps
these in ``accelerate.utils.operations``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def recursively_apply(fn: Callable[[torch.Tensor], Any], data: Any, *, error_on_other: bool = True) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        out = {k: recursively_apply(fn, v, error_on_other=error_on_other) for k, v in data.items()}
        try:  # keep the mapping's own type (an OrderedDict, a BatchEncoding) where it can be rebuilt
            return type(data)(out)  # type: ignore[call-arg]
        except TypeError:
            return out
    if isinstance(data, (list, tuple)):
        items = [recursively_apply(fn, d, error_on_other=error_on_other) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if error_on_other:
        raise TypeError(
            f"expected tensors or nested lists/tuples/dicts of tensors, got {type(data).__name__}; "
            "use gather_object (or gather_for_metrics(..., use_gather_object=True)) for other objects."
        )
    return data


def send_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``; other leaves stay as they are."""
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), obj, error_on_other=False)
