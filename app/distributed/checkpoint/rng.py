"""Random number generator states in a checkpoint (``rng_state_<rank>``): python, numpy and torch,
plus the device's (e.g. ``cuda``, ``xla``) under the keys its ``DeviceOps`` chose, stored without
pickle by ``format.write_state``."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from app.distributed.checkpoint.store import Manifest, read_state, state_file

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend


def capture_rng(backend: Backend) -> dict[str, Any]:
    """This process's RNG states in a form ``format.flatten`` stores without pickle."""
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "key": np.asarray(key).tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    state.update(backend.rng_state())
    return state


def apply_rng(state: dict[str, Any], backend: Backend) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    backend.set_rng_state(state)


def restore_rng(folder: Path, backend: Backend, manifest: Manifest) -> None:
    """Restore this rank's RNG states. A rank that did not exist when the checkpoint was written
    (more processes now) gets fresh streams seeded from the step and its rank: dropout masks and
    the like cannot continue exactly across a change of world size."""
    rank = backend.process_index
    if state_file(folder, f"rng_state_{rank}") is not None:
        apply_rng(read_state(folder, f"rng_state_{rank}"), backend)
        return
    seed = (manifest.step * 1_000_003 + rank) % 2**31
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def preserved_rng(backend: Backend) -> Iterator[None]:
    """Random streams come out of the block as they went in (tracker start-up may draw from them,
    and a resumed run must continue the restored streams exactly)."""
    saved = capture_rng(backend)
    try:
        yield
    finally:
        apply_rng(saved, backend)
