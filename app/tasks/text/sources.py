"""Where a text task's raw splits come from, in this order of precedence:

- ``task.data_files``: one local file per split (CSV, TSV, JSON, JSON Lines, parquet, arrow) or a
  ``save_to_disk`` folder, read with ``datasets``' own builders;
- ``task.data_dir`` (GLUE presets): a folder in GLUE's layouts: its TSVs (``tsv``), the hub's
  ``<split>-*.parquet`` / ``.arrow`` files, or a ``save_to_disk`` folder, in the folder itself or
  in a subfolder named after the task (``mrpc/``, ``MRPC/``);
- ``task.dataset``: ``datasets.load_dataset(task.dataset, task.dataset_config)``, a hub name or a
  local folder.

Every source gives ``datasets.Dataset`` splits by name with a digest of their contents (which keys
the tokenization cache) and what messages call them (a file's path).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import ConfigError
from app.tasks.text.config import TextClassificationConfig
from app.tasks.text.glue import GlueSpec
from app.tasks.text.hub import hub_access
from app.tasks.text.tsv import read_glue_tsv

if TYPE_CHECKING:
    import datasets

FILE_FORMATS: dict[str, tuple[str, dict[str, str]]] = {
    ".csv": ("csv", {}), ".tsv": ("csv", {"delimiter": "\t"}), ".json": ("json", {}), ".jsonl": ("json", {}),
    ".parquet": ("parquet", {}), ".arrow": ("arrow", {}),
}
"""File suffix -> the ``datasets`` builder that reads it (a TSV is a CSV with tabs, quotes respected)."""


@dataclass
class Split:
    """One raw split, a digest of its source contents (part of the tokenization cache key), and its
    name in messages (a path, or the dataset and split)."""

    data: datasets.Dataset
    fingerprint: str
    origin: str


def load_splits(cfg: TextClassificationConfig, spec: GlueSpec | None, eval_splits: Sequence[str], test_split: str,
                raw_cache: Path) -> dict[str, Split]:
    """train, the evaluation splits and the test split, those the source has (by these names: a
    validation file is the first evaluation split, MNLI's validation_matched)."""
    if cfg.data_files.train is not None:
        files = {"train": ("train", cfg.data_files.train), eval_splits[0]: ("validation", cfg.data_files.validation),
                 test_split: ("test", cfg.data_files.test)}
        return {split: read_file(path, key, raw_cache) for split, (key, path) in files.items() if path is not None}
    if cfg.data_dir is not None and spec is not None:
        return load_glue_folder(cfg.data_dir, spec)
    assert cfg.dataset is not None  # the schema's check: one of the three is given
    return load_dataset_splits(cfg.dataset, cfg.dataset_config, spec, ["train", *eval_splits, test_split])


def check_local_paths(cfg: TextClassificationConfig) -> None:
    """Missing local files and folders, refused on every process alike before any of them waits for another."""
    check_data_files(cfg.data_files)
    if cfg.data_files.train is None and cfg.data_dir is not None:
        local_root(cfg.data_dir)


def check_data_files(data_files: object) -> None:
    """Each split's file of a ``task.data_files`` dataclass must exist (one sentence naming the first missing)."""
    for split in dataclasses.fields(data_files):  # type: ignore[arg-type]
        path = getattr(data_files, split.name)
        if path is not None and not Path(path).expanduser().exists():
            raise ConfigError(f"task.data_files.{split.name}={path} does not exist.")


def read_file(path_text: str, split: str, raw_cache: Path,
              formats: dict[str, tuple[str, dict[str, str]]] = FILE_FORMATS) -> Split:
    """One split (``task.data_files.<split>``) from a local file (its suffix says the format, by
    ``formats``: a task may read more kinds, causal_lm plain text) or a ``save_to_disk`` folder (a
    DatasetDict's split of that name)."""
    import datasets

    path = Path(path_text).expanduser()
    where = f"task.data_files.{split}={path_text}"
    if not path.exists():
        raise ConfigError(f"{where} does not exist.")
    if path.is_dir():
        return Split(_saved_split(path, split, where), files_fingerprint(p for p in path.rglob("*") if p.is_file()),
                     str(path))
    builder = formats.get(path.suffix.lower())
    if builder is None:
        *others, last = formats
        raise ConfigError(f"{where} is not a file the task reads: give a {', '.join(others)} or {last} file, or a "
                          "save_to_disk folder.")
    name, options = builder
    try:
        data = datasets.load_dataset(name, data_files={"train": [str(path)]}, split="train",
                                     cache_dir=str(raw_cache), **options)
    except Exception as err:  # noqa: BLE001 - pandas, pyarrow and json each fail their own way
        cause = err.__cause__ or err  # datasets wraps the reader's error in "An error occurred while generating"
        if "corresponds to no data" in str(err) or type(cause).__name__ == "EmptyDataError":
            raise ConfigError(f"{path} holds no rows.") from None
        raise ConfigError(f"{path} cannot be read as {path.suffix.lstrip('.').upper()} ({_first_line(cause)}).") \
            from None
    return Split(data, files_fingerprint([path]), str(path))


def _saved_split(folder: Path, split: str, where: str) -> datasets.Dataset:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{where} is a folder but not one that datasets' save_to_disk wrote ({_first_line(err)}).") \
            from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"{where} holds the splits {', '.join(loaded)}, and no {split} split.")
        return loaded[split]
    return loaded


def load_dataset_splits(name: str, config: str | None, spec: GlueSpec | None, splits: list[str]) -> dict[str, Split]:
    """``datasets.load_dataset(name, config)``: the hub, or a local folder of data files."""
    import datasets

    try:
        with hub_access(name):
            loaded = datasets.load_dataset(name, config)
    except Exception as err:  # offline, unknown name, no such config...: all mean "use local files"
        what = f"GLUE {spec.title}" if spec is not None else "the dataset"
        local = ("task.data_dir=<folder with GLUE's train.tsv and dev.tsv>" if spec is not None
                 else "task.data_files.train=<file>")
        raise ConfigError(f"Could not load {what} with datasets.load_dataset({name!r}, {config!r}) "
                          f"({_first_line(err)}); set {local} to use local files.") from err
    found = {split: loaded[split] for split in splits if split in loaded}
    if "train" not in found:
        raise ConfigError(f"datasets.load_dataset({name!r}, {config!r}) has no train split (it has "
                          f"{', '.join(loaded)}).")
    return {split: Split(data, files_fingerprint(_cache_paths(data)) + data._fingerprint, f"{name} {split} split")
            for split, data in found.items()}


def local_root(data_dir: str) -> Path:
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"task.data_dir={data_dir} is not an existing folder.")
    return root


def load_glue_folder(data_dir: str, spec: GlueSpec) -> dict[str, Split]:
    """The first layout, in ``data_dir`` or one of the spec's subfolders, that has train and the
    main evaluation split."""
    root = local_root(data_dir)
    loaders: tuple[Callable[[Path, GlueSpec], dict[str, Split]], ...] = (
        _saved_dataset_dict, _tsv_splits, _parquet_splits, _arrow_splits)
    main_eval = spec.eval_splits[0]
    for folder in (root, *(root / name for name in spec.folders)):
        if not folder.is_dir():
            continue
        for loader in loaders:
            splits = loader(folder, spec)
            if "train" in splits and main_eval in splits:
                return splits
    dev = " or ".join(spec.tsv_names(main_eval))
    raise ConfigError(
        f"task.data_dir={data_dir} has no {spec.title} train and {main_eval} splits (expected train.tsv and {dev}, "
        f"train-*.parquet and {main_eval}-*.parquet, or a save_to_disk folder)."
    )


def _splits(spec: GlueSpec) -> tuple[str, ...]:
    return ("train", *spec.eval_splits, spec.test_split)


def _saved_dataset_dict(folder: Path, spec: GlueSpec) -> dict[str, Split]:
    import datasets

    if not (folder / "dataset_dict.json").is_file():
        return {}
    loaded = datasets.load_from_disk(str(folder))
    return {s: Split(loaded[s], files_fingerprint(_cache_paths(loaded[s])), f"{folder} {s} split")
            for s in _splits(spec) if s in loaded}


def _tsv_splits(folder: Path, spec: GlueSpec) -> dict[str, Split]:
    splits = {}
    for split in _splits(spec):
        path = next((folder / n for n in spec.tsv_names(split) if (folder / n).is_file()), None)
        if path is not None:
            layout = spec.test if split == spec.test_split else spec.labeled
            splits[split] = Split(read_glue_tsv(path, spec, layout), files_fingerprint([path]), str(path))
    return splits


def _parquet_splits(folder: Path, spec: GlueSpec) -> dict[str, Split]:
    return _file_splits(folder, spec, "parquet")


def _arrow_splits(folder: Path, spec: GlueSpec) -> dict[str, Split]:
    return _file_splits(folder, spec, "arrow")


def _file_splits(folder: Path, spec: GlueSpec, ext: str) -> dict[str, Split]:
    """Hub-style files: ``train.parquet`` or shards ``train-00000-of-00001.parquet`` (same for arrow)."""
    import datasets

    splits = {}
    for split in _splits(spec):
        for stem in (split, "dev") if split == "validation" else (split,):
            files = sorted({*folder.glob(f"{stem}.{ext}"), *folder.glob(f"{stem}-*.{ext}")})
            if files:
                data = datasets.load_dataset(ext, data_files={split: [str(f) for f in files]}, split=split)
                splits[split] = Split(data, files_fingerprint(files), str(files[0]))
                break
    return splits


def _cache_paths(ds: datasets.Dataset) -> list[Path]:
    return [Path(c["filename"]) for c in ds.cache_files]


def _first_line(err: BaseException) -> str:
    """An error's first line as a clause inside our one sentence."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".").replace(". ", "; ")


def files_fingerprint(paths: Iterable[Path]) -> str:
    """Digest of the files' names and bytes (MRPC is a few MB; hashing it takes milliseconds)."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
