"""Checkpoint file formats, without pickle: tensors in safetensors, everything else in JSON.

A nested state (an optimizer's ``state_dict``, RNG states, a scheduler) is split by :func:`flatten`
into its tensors and a JSON *skeleton* in which each tensor is replaced by ``{"__tensor__": key}``.
:func:`write_state` stores both in one file: ``<name>.json`` when there is no tensor, else
``<name>.safetensors`` with the skeleton in the header's metadata. Reading parses JSON and
safetensors headers only, so loading a checkpoint can never execute code from it.

Files are written in two phases, so the disk and the CPU work at the same time: the writers
(:func:`write_safetensors`, :func:`write_bytes`, :func:`write_state`) put the bytes in the page
cache and return a :class:`WrittenFile` that still references them; :func:`finish` then fsyncs the
files on a helper thread while it computes their SHA-256 (for the manifest) from the same bytes in
memory, never reading a file back. A checkpoint is committed only after ``finish``.

A checkpoint's files are first *staged* (:func:`stage_safetensors`, :func:`stage_state`: the bytes
laid out in memory, copied off the training objects for an asynchronous save, see ``staging``) as a
:class:`PendingFile`, whose ``write()`` is the first phase: at once for a synchronous save, on the
writer thread for an asynchronous one.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.distributed.checkpoint.atomic import fsync_paths
from app.distributed.checkpoint.errors import CheckpointError, first_line
from app.distributed.checkpoint.staging import Staging

# safetensors' dtype names (https://github.com/huggingface/safetensors, "Format").
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name

SKELETON_KEY = "skeleton"
"""Metadata key of a state file's JSON skeleton."""
_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"


@dataclass(frozen=True)
class FileDigest:
    """What the manifest records for one file."""

    sha256: str
    size: int


@dataclass
class WrittenFile:
    """A file whose bytes are in the page cache, not yet fsynced nor hashed (see :func:`finish`)."""

    path: Path
    chunks: list[bytes | memoryview]
    size: int


def _write(path: Path, chunks: list[bytes | memoryview]) -> WrittenFile:
    with open(path, "wb") as f:
        for chunk in chunks:
            if len(chunk):
                f.write(chunk)
    return WrittenFile(path, chunks, sum(len(c) for c in chunks))


@dataclass
class PendingFile:
    """A checkpoint file staged in memory (``name`` inside its folder, at ``path``), not yet written."""

    name: str
    path: Path
    chunks: list[bytes | memoryview]

    def write(self) -> dict[str, WrittenFile | Path]:
        return {self.name: _write(self.path, self.chunks)}


def finish(files: dict[str, WrittenFile | Path]) -> dict[str, FileDigest]:
    """Make the files durable and hash them: fsync runs on a helper thread (it waits on the disk,
    without the GIL) while this thread hashes the bytes, so hashing costs little extra wall time.
    A plain Path (a file some library wrote) is hashed by reading it."""
    paths = [f.path if isinstance(f, WrittenFile) else f for f in files.values()]
    with ThreadPoolExecutor(max_workers=1) as pool:
        synced = pool.submit(fsync_paths, paths)
        digests = {}
        for name, written in files.items():
            if isinstance(written, Path):
                digests[name] = FileDigest(sha256_file(written), written.stat().st_size)
                continue
            hasher = hashlib.sha256()
            for chunk in written.chunks:
                hasher.update(chunk)
            digests[name] = FileDigest(hasher.hexdigest(), written.size)
        synced.result()
    return digests


def write_bytes(path: Path, data: bytes) -> WrittenFile:
    return _write(path, [data])


def write_json(path: Path, obj: Any) -> WrittenFile:
    return write_bytes(path, _json_bytes(obj))


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in safetensors order (little-endian, row-major), without a copy when it
    is already a contiguous CPU tensor."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
                      ) -> WrittenFile:
    """A standard safetensors file (readable by ``safetensors.safe_open`` and ``from_pretrained``),
    written straight from the tensors' memory.

    We write the format ourselves, rather than calling ``safetensors.torch.save_file``, so that
    :func:`finish` can hash the very buffers that were written instead of reading the file back.
    Tensors must not share storage (see :func:`dedupe_shared`).
    """
    return _write(path, _safetensors_chunks(path.name, tensors, metadata, Staging()))


def stage_safetensors(folder: Path, file: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None,
                      staging: Staging) -> PendingFile:
    """:func:`write_safetensors`'s file ``folder / file``, staged (its tensors copied with ``staging.copy``)."""
    return PendingFile(file, folder / file, _safetensors_chunks(file, tensors, metadata, staging))


def _safetensors_chunks(file: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None,
                        staging: Staging) -> list[bytes | memoryview]:
    if sys.byteorder != "little":
        raise RuntimeError("checkpoints are written on little-endian machines only.")
    header: dict[str, Any] = {}
    buffers: list[bytes | memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store.")
        data = _raw_bytes(staging.host(f"{file}/{name}", tensor))
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        buffers.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to a multiple of 8 bytes
    return [struct.pack("<Q", len(encoded)) + encoded, *buffers]


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and header metadata of a safetensors file (no code runs: the header is JSON).
    A file that is not one raises CheckpointError naming it."""
    from safetensors import safe_open

    if problem := check_file(path):
        raise CheckpointError(f"{path} {problem}.")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
            return tensors, dict(f.metadata() or {})
    except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError...
        raise CheckpointError(f"{path} is not a readable safetensors file ({first_line(err)}).") from None


# -- well-formedness, checked before a file is loaded ---------------------------------------------------

MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own limit on a header; a larger claimed length is refused before it is read."""
MAX_JSON_BYTES = 256 * 2**20
MAX_JSON_DEPTH = 64
"""The deepest nesting our states need is about ten; a deeper JSON (or skeleton) is not ours."""
_ITEM_SIZES = {name: torch.empty((), dtype=dtype).element_size() for dtype, name in _DTYPE_NAMES.items()}


def _json_problem(text: str | bytes) -> str | None:
    """None when ``text`` is JSON nested at most MAX_JSON_DEPTH deep; else what is wrong."""
    try:
        value = json.loads(text)
    except RecursionError:
        return "is nested too deeply to be ours"
    except (ValueError, UnicodeDecodeError) as err:
        return f"is not valid JSON ({first_line(err)})"
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"is nested more than {MAX_JSON_DEPTH} levels deep"
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return None


def check_file(path: Path) -> str | None:
    """None when a checkpoint file is well-formed for its kind (``.json``, ``.safetensors``; other
    names are not parsed); else what is wrong, as a phrase after the file name. Reads only a
    safetensors header (its claimed length bounded by the file) or a bounded JSON file, so a
    crafted file costs neither memory nor time, and never runs code."""
    size = path.stat().st_size
    if path.suffix == ".json":
        if size > MAX_JSON_BYTES:
            return f"has {size} bytes, more than a checkpoint's JSON state can hold"
        return _json_problem(path.read_bytes())
    if path.suffix != ".safetensors":
        return None
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return "is too short to be a safetensors file"
        length = struct.unpack("<Q", prefix)[0]
        if length > min(size - 8, MAX_HEADER_BYTES):
            return f"claims a safetensors header of {length} bytes, more than the file (or the format) holds"
        header_bytes = f.read(length)
    if problem := _json_problem(header_bytes):
        return f"has a safetensors header that {problem}"
    header = json.loads(header_bytes)
    if not isinstance(header, dict):
        return "has a safetensors header that is not a JSON object"
    data_bytes = size - 8 - length
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                return "has safetensors metadata that is not a string map"
            for name in (SKELETON_KEY, "aliases"):
                if name in entry and (problem := _json_problem(entry[name])):
                    return f"has a {name} that {problem}"
            continue
        problem = _tensor_entry_problem(entry, data_bytes)
        if problem:
            return f"has tensor {key!r} {problem}"
    return None


def _tensor_entry_problem(entry: Any, data_bytes: int) -> str | None:
    if not isinstance(entry, dict) or entry.get("dtype") not in _ITEM_SIZES:
        return "with an unknown dtype"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return "with a malformed shape"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        return f"with data offsets {offsets} outside the file's {data_bytes} data bytes"
    needed = math.prod(shape) * _ITEM_SIZES[entry["dtype"]]
    if offsets[1] - offsets[0] != needed:
        return f"claiming {needed} bytes for shape {shape} where the file holds {offsets[1] - offsets[0]}"
    return None


# -- nested states ---------------------------------------------------------------------------------


def flatten(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested state into a JSON-ready skeleton and its tensors (keyed by their path)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            key = path or "tensor"
            while key in tensors:
                key += "'"
            tensors[key] = obj
            return {_TENSOR: key}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, dict):
            items = [(k, walk(v, f"{path}.{k}" if path else str(k))) for k, v in obj.items()]
            if all(isinstance(k, str) and not k.startswith("__") for k, _ in items):
                return dict(items)
            # Non-string keys (an optimizer's parameter ids) would become strings in JSON.
            return {_DICT: [[walk(k, ""), v] for k, v in items]}
        if isinstance(obj, tuple):
            return {_TUPLE: [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if hasattr(obj, "item") and getattr(obj, "shape", None) == ():  # numpy scalars
            return obj.item()
        raise TypeError(f"cannot checkpoint {type(obj).__name__} at {path or 'the top level'} without pickle.")

    return walk(state, ""), tensors


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        if _TUPLE in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton[_TUPLE])
        if _DICT in skeleton:
            return {unflatten(k, tensors): unflatten(v, tensors) for k, v in skeleton[_DICT]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    return skeleton


def write_state(folder: Path, name: str, state: Any) -> dict[str, WrittenFile]:
    """Write a nested state as ``<name>.json`` or, when it holds tensors, ``<name>.safetensors``."""
    staged = stage_state(folder, name, state, Staging())
    return {staged.name: _write(staged.path, staged.chunks)}


def stage_state(folder: Path, name: str, state: Any, staging: Staging) -> PendingFile:
    """:func:`write_state`'s file, staged: the skeleton is JSON at once, the tensors are copied with
    ``staging.copy``, so that nothing the file holds changes with the training objects."""
    skeleton, tensors = flatten(state)
    if not tensors:
        file = f"{name}.json"
        return PendingFile(file, folder / file, [_json_bytes(skeleton)])
    file = f"{name}.safetensors"
    unique, aliases = dedupe_shared(tensors)
    metadata = {SKELETON_KEY: json.dumps(skeleton), "aliases": json.dumps(aliases)}
    return stage_safetensors(folder, file, unique, metadata, staging)


def read_state_file(path: Path) -> Any:
    """The state :func:`write_state` wrote into ``path``; CheckpointError (naming the file) when it is
    not well-formed. (``store.read_state`` finds the file of a state by the folder's manifest.)"""
    if problem := check_file(path):
        raise CheckpointError(f"{path} {problem}.")
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text())
        tensors, metadata = read_safetensors(path)
        for alias, original in json.loads(metadata.get("aliases", "{}")).items():
            tensors[alias] = tensors[original]
        return unflatten(json.loads(metadata[SKELETON_KEY]), tensors)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path} does not hold a state this program wrote ({first_line(err)}).") from None


# -- shared storage --------------------------------------------------------------------------------


def dedupe_shared(tensors: dict[str, torch.Tensor], drop_first: set[str] | frozenset[str] = frozenset()
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Make a dict safetensors accepts: tensors that are the same view of one storage (tied
    weights) are stored once, the others named in ``aliases`` (alias -> stored name); different
    views of one storage are cloned, as transformers does.

    Which name of a tied group is stored: one not in ``drop_first`` (for a Transformers model, the
    tie *targets*, which ``from_pretrained`` re-ties), else the first in order.
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    by_storage: dict[Any, list[str]] = {}
    for name, t in tensors.items():
        if t.device.type == "meta" or t.numel() == 0:
            continue
        try:
            storage = (t.device, t.untyped_storage().data_ptr())
        except RuntimeError:  # a lazy device's tensor (XLA) exposes no storage: stored as it is
            continue
        by_storage.setdefault(storage, []).append(name)
        groups.setdefault((storage, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), []).append(name)
    shared = {s for s, names in by_storage.items() if len(names) > 1}
    unique = dict(tensors)
    aliases: dict[str, str] = {}
    for key, names in groups.items():
        if key[0] not in shared:
            continue
        keep = next((n for n in names if n not in drop_first), names[0])
        for name in names:
            if name != keep:
                aliases[name] = keep
                del unique[name]
        if len(by_storage[key[0]]) > len(names):
            unique[keep] = unique[keep].clone()  # another view of the storage exists: copy this one
    return unique, aliases


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            hasher.update(data)
    return hasher.hexdigest()
