"""What a process can ask and do knowing only its backend: its place among the processes, waiting
for the others, running code on one of them, splitting inputs between them. Shared by
``Accelerator`` and ``PartialState`` (Accelerate offers these on both)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from app.distributed.backends.base import Backend
from app.distributed.hardware.kinds import DistributedType

F = TypeVar("F", bound=Callable[..., Any])


class ProcessControl:
    """Mixin: subclasses provide ``backend`` (the Accelerator an attribute, the state objects a property
    answering for the live backend)."""

    if TYPE_CHECKING:
        @property
        def backend(self) -> Backend: ...

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def num_processes(self) -> int:
        return self.backend.num_processes

    @property
    def process_index(self) -> int:
        return self.backend.process_index

    @property
    def local_process_index(self) -> int:
        return self.backend.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.backend.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.backend.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.backend.process_index == self.backend.num_processes - 1

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType(self.backend.distributed_type)

    @property
    def use_distributed(self) -> bool:
        return self.backend.num_processes > 1

    def wait_for_everyone(self) -> None:
        self.backend.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. to fill a cache), then the others."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def _on(self, condition: Callable[[], bool], function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if condition():
                return function(*args, **kwargs)
            return None

        return wrapper  # type: ignore[return-value]

    def on_main_process(self, function: F) -> F:
        """Decorator: run the function on the main process only."""
        return self._on(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: F) -> F:
        return self._on(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: F) -> F:
        return self._on(lambda: self.is_last_process, function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._on(lambda: self.process_index == process_index, function)

    def on_local_process(self, function: F | None = None, local_process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._on(lambda: self.local_process_index == local_process_index, function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine (on the local main process)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of a list, tuple, tensor, dict of those, or the
        rows of a ``datasets.Dataset``.

        Shares differ by at most one element; with ``apply_padding`` the short shares are padded with
        their last element so every process gets the same length (drop the extras after gathering).
        """
        n, i = self.num_processes, self.process_index
        if n == 1:
            yield inputs
            return
        length = len(next(iter(inputs.values()))) if isinstance(inputs, dict) else len(inputs)
        per, extra = divmod(length, n)
        start = i * per + min(i, extra)
        end = start + per + (1 if i < extra else 0)
        target = per + (1 if extra else 0)
        yield {k: _share(v, start, end, target, apply_padding) for k, v in inputs.items()} \
            if isinstance(inputs, dict) else _share(inputs, start, end, target, apply_padding)


def _share(seq: Any, start: int, end: int, target: int, apply_padding: bool) -> Any:
    if _is_hf_dataset(seq):
        # Indexing a Dataset with a slice returns a dict of columns; select() keeps rows.
        rows = list(range(start, min(end, len(seq))))
        if apply_padding and len(seq):
            rows += [rows[-1] if rows else len(seq) - 1] * (target - len(rows))
        return seq.select(rows)
    part = seq[start:end]
    if apply_padding and len(part) < target and len(seq) > 0:
        fill = part[-1:] if len(part) else seq[-1:]
        if isinstance(part, torch.Tensor):
            part = torch.cat([part] + [fill] * (target - len(part)))
        else:
            part = part + type(part)(fill) * (target - len(part))
    return part


def _is_hf_dataset(obj: Any) -> bool:
    return type(obj).__name__ == "Dataset" and hasattr(obj, "select") and hasattr(obj, "column_names")
