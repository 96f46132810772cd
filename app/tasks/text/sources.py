"""Where a GLUE task's raw splits come from: the hub, or a local folder in one of three layouts.

Every source ends up as ``datasets.Dataset`` splits with the hub's columns (the spec's text columns,
label, idx) and a digest of the source files' contents, which keys the tokenization cache.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import ConfigError
from app.tasks.glue.config import GlueConfig, GlueSpec
from app.tasks.glue.hub import hub_access
from app.tasks.glue.tsv import read_glue_tsv

if TYPE_CHECKING:
    import datasets

SPLITS = ("train", "validation", "test")
_TSV_NAMES = {"train": ("train.tsv",), "validation": ("validation.tsv", "dev.tsv"), "test": ("test.tsv",)}
_FILE_STEMS = {"train": ("train",), "validation": ("validation", "dev"), "test": ("test",)}
_HUB_ERROR = (
    "Could not load GLUE {title} from the hub ({name}); set task.data_dir=<folder with train.tsv and "
    "validation.tsv> to use local files."
)


@dataclass
class Split:
    """One raw split and a digest of its source contents (part of the tokenization cache key)."""

    data: datasets.Dataset
    fingerprint: str


def load_splits(cfg: GlueConfig, spec: GlueSpec) -> dict[str, Split]:
    """train, validation and (when present) test, from cfg.data_dir or else from the hub."""
    if cfg.data_dir is not None:
        return load_local_splits(cfg.data_dir, spec)
    return load_hub_splits(cfg.hub_dataset, spec)


def load_hub_splits(name: str, spec: GlueSpec) -> dict[str, Split]:
    import datasets

    try:
        with hub_access(name):
            loaded = datasets.load_dataset(name, spec.config)
    except Exception as e:  # offline, unknown name, no such config...: all mean "use local files"
        raise ConfigError(_HUB_ERROR.format(title=spec.title, name=name)) from e
    return {s: Split(loaded[s], files_fingerprint(_cache_paths(loaded[s]))) for s in SPLITS if s in loaded}


def local_root(data_dir: str) -> Path:
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"task.data_dir={data_dir} is not an existing folder.")
    return root


def load_local_splits(data_dir: str, spec: GlueSpec) -> dict[str, Split]:
    """The first layout, in ``data_dir`` or one of the spec's subfolders, that has train and validation."""
    root = local_root(data_dir)
    loaders = (load_saved_dataset_dict, functools.partial(load_tsv_splits, spec=spec), load_parquet_splits,
               load_arrow_splits)
    for folder in (root, *(root / name for name in spec.folders)):
        if not folder.is_dir():
            continue
        for loader in loaders:
            splits = loader(folder)
            if "train" in splits and "validation" in splits:
                return splits
    raise ConfigError(
        f"task.data_dir={data_dir} has no {spec.title} train and validation splits (expected train.tsv and "
        "validation.tsv or dev.tsv, train-*.parquet and validation-*.parquet, or a save_to_disk folder)."
    )


def load_saved_dataset_dict(folder: Path) -> dict[str, Split]:
    import datasets

    if not (folder / "dataset_dict.json").is_file():
        return {}
    loaded = datasets.load_from_disk(str(folder))
    return {s: Split(loaded[s], files_fingerprint(_cache_paths(loaded[s]))) for s in SPLITS if s in loaded}


def load_tsv_splits(folder: Path, spec: GlueSpec) -> dict[str, Split]:
    splits = {}
    for split, names in _TSV_NAMES.items():
        path = next((folder / n for n in names if (folder / n).is_file()), None)
        if path is not None:
            splits[split] = Split(read_glue_tsv(path, spec), files_fingerprint([path]))
    return splits


def load_parquet_splits(folder: Path) -> dict[str, Split]:
    return _load_file_splits(folder, "parquet")


def load_arrow_splits(folder: Path) -> dict[str, Split]:
    return _load_file_splits(folder, "arrow")


def _load_file_splits(folder: Path, ext: str) -> dict[str, Split]:
    """Hub-style files: ``train.parquet`` or shards ``train-00000-of-00001.parquet`` (same for arrow)."""
    import datasets

    splits = {}
    for split, stems in _FILE_STEMS.items():
        for stem in stems:
            files = sorted({*folder.glob(f"{stem}.{ext}"), *folder.glob(f"{stem}-*.{ext}")})
            if files:
                data = datasets.load_dataset(ext, data_files={split: [str(f) for f in files]}, split=split)
                splits[split] = Split(data, files_fingerprint(files))
                break
    return splits


def _cache_paths(ds: datasets.Dataset) -> list[Path]:
    return [Path(c["filename"]) for c in ds.cache_files]


def files_fingerprint(paths: Iterable[Path]) -> str:
    """Digest of the files' names and bytes (MRPC is a few MB; hashing it takes milliseconds)."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
