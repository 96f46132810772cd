"""``find_executable_batch_size``: retry a function with half the batch size after running out of
device memory (Accelerate's decorator, same signature)."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch


def should_reduce_batch_size(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error (of any device's allocator)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    # The allocators' messages: "<DEVICE> out of memory.", "<DEVICE> error: out of memory",
    # "DefaultCPUAllocator: can't allocate memory".
    messages = ("out of memory", "can't allocate memory")
    return isinstance(error, RuntimeError) and len(error.args) == 1 and isinstance(error.args[0], str) and \
        any(m in error.args[0] for m in messages)


def find_executable_batch_size(function: Callable[..., Any] | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Any:
    """Decorate ``function(batch_size, *args)``: called with ``starting_batch_size``, then with half
    as much after each out-of-memory error, until it succeeds; raises once the size reaches 0.

    >>> @find_executable_batch_size(starting_batch_size=64)
    ... def train(batch_size, model):
    ...     ...
    >>> train(model)   # batch_size is supplied by the decorator
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size
    reduce = reduce_batch_size_fn or (lambda: batch_size // 2)

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        gc.collect()
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            arg_str = ", ".join(f"{name}={value}" for name, value in zip(params[1:], args[1:]))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when called. "
                            f"Remove this as the decorator already does so: `{function.__name__}({arg_str})`")
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
                gc.collect()
                from app.distributed.state import live_backend

                live_backend().free_memory()
                batch_size = reduce()

    return decorator
