"""Input prefetch: a host thread collates the next batches and copies them to the device while the
device computes the current step. The XLA backend feeds its prepared loaders through it (sharding
each batch over the mesh on the way), as torch_xla's ``ParallelLoader`` / ``MpDeviceLoader`` do.

Why not ``MpDeviceLoader`` itself: its per-device loader cuts the graph (``torch_xla.sync()``) at
every batch it hands out, a second cut beside the optimizer step's that would run the loss
accumulation of each step as a graph of its own; and its ``input_sharding`` is one spec for every
tensor (or one per key of a dict batch), where our batches mix ranks (images and labels) and need a
spec per rank. The thread, the bounded queue and the transfer call are the same.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

_END = object()


def prefetched(batches: Iterator[Any], place: Callable[[Any], Any], depth: int) -> Generator[Any, None, None]:
    """``place(batch)`` for each of ``batches``, in order, computed by a background thread up to
    ``depth`` batches ahead of the consumer. An error while loading or placing is raised here, at the
    batch it concerns. Closing the generator (the loader's pass ends, or a stop abandons it) stops the
    thread: at most the batch it is working on is finished, and discarded."""
    ready: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for batch in batches:
                ready.put((place(batch), None))
                if stop.is_set():
                    return
            ready.put((_END, None))
        except BaseException as error:  # noqa: BLE001  (handed to the consumer, raised in its thread)
            ready.put((_END, error))

    worker = threading.Thread(target=produce, name="device-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # make room for a put the thread may be blocked in, until it sees stop
            try:
                ready.get(timeout=0.05)
            except queue.Empty:
                pass
        worker.join()
