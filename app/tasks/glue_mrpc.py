"""GLUE MRPC: does a sentence pair paraphrase? A Hugging Face encoder, accuracy and binary F1.

Data comes from the hub (``datasets.load_dataset(cfg.hub_dataset, "mrpc")``) or from
``cfg.data_dir``: GLUE TSV files, Hugging Face parquet/arrow files, or a ``save_to_disk`` folder.
Every source ends up as ``datasets.Dataset`` splits with the hub's columns
(sentence1, sentence2, label, idx).

Tokenized splits are cached on disk under a key made of everything that changes the token ids
(tokenizer contents, max_length, padding mode, the source data's contents), so a different
tokenizer or max_length never reuses a stale cache, and the other processes of a distributed run
read what the main process wrote.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import io
import json
import logging
import shutil
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import StepOutput, TaskData
from app.tasks.glue_mrpc_config import GlueMrpcConfig, Pooling
from app.tasks.metrics import classification_metrics

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

LABEL_NAMES = ("not_equivalent", "equivalent")
"""Hub names of labels 0 and 1, also written into the exported model's config."""
SPLITS = ("train", "validation", "test")
UNLABELED = -1
"""Label of a row without gold label (GLUE's own test.tsv; the hub's test split)."""
IGNORE_INDEX = -100
"""What such rows carry as ``labels``: cross-entropy skips them instead of failing on -1."""
CACHE_VERSION = 1
"""Part of the cache key: bump it when ``_encode`` changes what it produces."""

T = TypeVar("T")
log = logging.getLogger(__name__)

_TSV_NAMES = {"train": ("train.tsv",), "validation": ("validation.tsv", "dev.tsv"), "test": ("test.tsv",)}
_FILE_STEMS = {"train": ("train",), "validation": ("validation", "dev"), "test": ("test",)}
_HUB_ERROR = (
    "Could not load GLUE MRPC from the hub ({name}); set task.data_dir=<folder with train.tsv and "
    "validation.tsv> to use local files."
)


@dataclass
class Split:
    """One raw split and a digest of its source contents (part of the tokenization cache key)."""

    data: datasets.Dataset
    fingerprint: str


# -- the task ------------------------------------------------------------------------------------------


class GlueMrpcTask:
    name = "glue_mrpc"
    metric_names: tuple[str, ...] = ("loss", "accuracy", "f1")
    num_labels = 2

    def __init__(self, cfg: GlueMrpcConfig):
        cfg.check()  # also when built from a config that did not pass through app.configure.validate
        self.cfg = cfg
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._runtime: Any = None
        self._raw_test: Split | None = None
        self._test: datasets.Dataset | None = None

    # The tokenizer is loaded on first use: build_data, save_artifacts and the tests all need it,
    # and building the task (e.g. to validate a config) should not touch the disk or network.
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.tokenizer or self.cfg.model)
        return self._tokenizer

    def build_data(self, runtime: Any) -> TaskData:
        self._runtime = runtime
        if self.cfg.data_dir is not None:
            local_root(self.cfg.data_dir)  # fail on every process alike, before any barrier
        if not getattr(runtime, "is_main_process", True):
            import datasets

            # Tokenization shows its progress ("Tokenizing MRPC train") once, from the main process.
            datasets.disable_progress_bars()
        splits = _run_main_first(runtime, self._load_and_tokenize)
        train, validation, self._raw_test = splits
        if self.cfg.predict_test and self._raw_test is None:
            raise ConfigError("task.predict_test=true needs a test split, and the MRPC data has none.")
        lengths = [len(ids) for ids in train["input_ids"]]
        # A compiling backend (XLA) builds one program per shape: every batch then has max_length tokens.
        fixed_length = self.cfg.max_length if getattr(runtime, "static_shapes", False) else None
        return TaskData(train=train, eval=validation, collate_fn=PairCollator(self.tokenizer, fixed_length),
                        train_lengths=lengths)

    def _load_and_tokenize(self) -> tuple[datasets.Dataset, datasets.Dataset, Split | None]:
        raw = load_splits(self.cfg)
        check_tokenizer_covers(self.tokenizer, self.cfg.tokenizer or self.cfg.model, raw["train"].data)
        train = self._tokenize(raw["train"], "train")
        if self.cfg.swap_pairs:
            import datasets

            train = datasets.concatenate_datasets([train, self._tokenize(raw["train"], "train", swap=True)])
        validation = self._tokenize_eval(raw["validation"], "validation")
        return train, validation, raw.get("test")

    def _tokenize(self, split: Split, name: str, swap: bool = False) -> datasets.Dataset:
        cfg = self.cfg
        return tokenize_split(
            split, name, self.tokenizer, cfg.max_length, cfg.pad_to_max_length, cache_root(cfg), swap=swap
        )

    def _tokenize_eval(self, split: Split, name: str) -> datasets.Dataset:
        """Evaluation rows: the pair, and with ``symmetric_eval`` the swapped pair beside it."""
        plain = self._tokenize(split, name)
        if not self.cfg.symmetric_eval:
            return plain
        return with_swapped_pairs(plain, self._tokenize(split, name, swap=True))

    def build_model(self) -> nn.Module:
        return load_model(self.cfg.model, self.num_labels, self.cfg.pooling)

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        # Smoothing regularises training; evaluation keeps the plain loss so eval/loss compares across runs.
        smoothing = self.cfg.label_smoothing if model.training else 0.0
        if not smoothing and SWAPPED + "input_ids" not in batch:
            out = model(**batch)
            return StepOutput(loss=out.loss, logits=out.logits, labels=batch["labels"])
        logits = self.predict(model, batch)
        loss = nn.functional.cross_entropy(logits.float(), batch["labels"], label_smoothing=smoothing)
        return StepOutput(loss=loss, logits=logits, labels=batch["labels"])

    def predict(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Logits only: unlike ``step`` it does not need gold labels.

        A batch that also carries the swapped pairs (``symmetric_eval``: evaluation and test rows,
        never training rows) is scored in both orders, and the mean of the two log-probabilities is
        returned as the logits: argmax, softmax and cross-entropy read it as a two-view ensemble.
        """
        inputs, swapped = split_swapped(batch)
        inputs.pop("labels", None)
        logits = model(**inputs).logits
        if not swapped:
            return logits
        other = model(**swapped).logits
        return (logits.float().log_softmax(dim=-1) + other.float().log_softmax(dim=-1)) / 2

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        return classification_metrics(logits, labels, f1_average="binary")

    def save_artifacts(self, model: nn.Module, folder: Path) -> None:
        """Tokenizer files and config.json, so that from_pretrained(folder) works once the weights are there."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        from app.tasks import mean_pooling

        self.tokenizer.save_pretrained(folder)
        config: Any = model.config
        config.architectures = [type(model).__name__]
        if isinstance(model, mean_pooling.MeanPoolingForSequenceClassification):
            # The model's code travels with it: the Auto classes load it with trust_remote_code=True.
            config.auto_map = mean_pooling.auto_map()
            shutil.copyfile(mean_pooling.__file__, folder / mean_pooling.MODULE_FILE)
        config.save_pretrained(folder)

    # -- test split (cfg.predict_test) -----------------------------------------------------------------

    def test_dataset(self) -> datasets.Dataset:
        """The tokenized test split, in file order; rows without gold label carry labels=-100."""
        if self._test is None:
            if self._raw_test is None:
                raise ConfigError("There is no MRPC test split to predict on (build_data has not found one).")
            raw_test = self._raw_test
            self._test = _run_main_first(self._runtime, lambda: self._tokenize_eval(raw_test, "test"))
        return self._test

    def write_predictions(self, preds: Iterable[int], path: str | Path) -> None:
        """GLUE submission format: a header, then ``index<TAB>prediction`` per test row, in order."""
        preds = [int(p) for p in preds]
        index = list(self._raw_test.data["idx"]) if self._raw_test is not None else list(range(len(preds)))
        if len(index) != len(preds):
            raise ValueError(f"got {len(preds)} predictions for {len(index)} test rows")
        lines = ["index\tprediction"] + [f"{i}\t{p}" for i, p in zip(index, preds)]
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _run_main_first(runtime: Any, work: Callable[[], T]) -> T:
    """Run ``work`` on the main process first (it fills the caches), then on the others.

    A ConfigError is raised only after the block: raised inside, the main process would skip the
    barrier that the others wait on, and they would hang until the collective timeout.
    """
    guard = getattr(runtime, "main_process_first", None)
    error: ConfigError | None = None
    with guard() if guard is not None else contextlib.nullcontext():
        try:
            result = work()
        except ConfigError as e:
            error = e
    if error is not None:
        raise error
    return result


# -- raw data ------------------------------------------------------------------------------------------


def load_splits(cfg: GlueMrpcConfig) -> dict[str, Split]:
    """train, validation and (when present) test, from cfg.data_dir or else from the hub."""
    if cfg.data_dir is not None:
        return load_local_splits(cfg.data_dir)
    return load_hub_splits(cfg.hub_dataset)


def load_hub_splits(name: str) -> dict[str, Split]:
    import datasets

    try:
        with hub_access(name):
            loaded = datasets.load_dataset(name, "mrpc")
    except Exception as e:  # offline, unknown name, no "mrpc" config...: all mean "use local files"
        raise ConfigError(_HUB_ERROR.format(name=name)) from e
    return {s: Split(loaded[s], files_fingerprint(_cache_paths(loaded[s]))) for s in SPLITS if s in loaded}


def local_root(data_dir: str) -> Path:
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"task.data_dir={data_dir} is not an existing folder.")
    return root


def load_local_splits(data_dir: str) -> dict[str, Split]:
    """The first layout, in ``data_dir`` or its ``mrpc`` subfolder, that has train and validation."""
    root = local_root(data_dir)
    loaders = (load_saved_dataset_dict, load_tsv_splits, load_parquet_splits, load_arrow_splits)
    for folder in (root, root / "mrpc"):
        if not folder.is_dir():
            continue
        for loader in loaders:
            splits = loader(folder)
            if "train" in splits and "validation" in splits:
                return splits
    raise ConfigError(
        f"task.data_dir={data_dir} has no MRPC train and validation splits (expected train.tsv and "
        "validation.tsv or dev.tsv, train-*.parquet and validation-*.parquet, or a save_to_disk folder)."
    )


def load_saved_dataset_dict(folder: Path) -> dict[str, Split]:
    import datasets

    if not (folder / "dataset_dict.json").is_file():
        return {}
    loaded = datasets.load_from_disk(str(folder))
    return {s: Split(loaded[s], files_fingerprint(_cache_paths(loaded[s]))) for s in SPLITS if s in loaded}


def load_tsv_splits(folder: Path) -> dict[str, Split]:
    splits = {}
    for split, names in _TSV_NAMES.items():
        path = next((folder / n for n in names if (folder / n).is_file()), None)
        if path is not None:
            splits[split] = Split(read_glue_tsv(path), files_fingerprint([path]))
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


def read_glue_tsv(path: Path) -> datasets.Dataset:
    """A GLUE-format MRPC TSV: header ``Quality  #1 ID  #2 ID  #1 String  #2 String``.

    The sentences hold literal, unbalanced ``"`` and are not quoted, so csv must not treat quotes
    specially (QUOTE_NONE). GLUE's own test.tsv has ``index`` instead of ``Quality``: no labels.
    """
    import datasets

    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # -sig: some copies start with a BOM
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(f"{path} line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x}), where a GLUE MRPC "
                          "TSV of sentence pairs was expected.") from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise ConfigError(f"{path} line {line} holds a NUL byte (binary data?), where a GLUE MRPC TSV of sentence "
                          "pairs was expected.")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    rows: list[tuple[int, list[str]]] = []
    try:
        for row in reader:
            if row:
                rows.append((reader.line_num, row))
    except csv.Error as err:
        raise ConfigError(f"{path} line {reader.line_num + 1} cannot be read as TSV ({err}), where a GLUE MRPC "
                          "TSV of sentence pairs was expected.") from None
    if not rows:
        raise ConfigError(f"{path} is empty, where a GLUE MRPC TSV with a header line was expected.")
    (_, header), body = rows[0], rows[1:]
    column = {name.strip(): i for i, name in enumerate(header)}
    if "#1 String" not in column or "#2 String" not in column:
        raise ConfigError(f"{path} is not a GLUE MRPC TSV: its header has no '#1 String' and '#2 String'.")
    if not body:
        raise ConfigError(f"{path} has a header line but no sentence pairs.")
    for line_no, row in body:
        if len(row) != len(header):
            raise ConfigError(
                f"{path} line {line_no} has {len(row)} fields where the header has {len(header)}."
            )
    label_col, index_col = column.get("Quality"), column.get("index")
    records = {
        "sentence1": [row[column["#1 String"]] for _, row in body],
        "sentence2": [row[column["#2 String"]] for _, row in body],
        "label": [_label(path, n, row[label_col]) if label_col is not None else UNLABELED for n, row in body],
        # The hub's idx is the 0-based row number; GLUE's test.tsv numbers its rows itself.
        "idx": [_integer(path, n, "index", row[index_col]) if index_col is not None else i
                for i, (n, row) in enumerate(body)],
    }
    features = datasets.Features(
        {
            "sentence1": datasets.Value("string"),
            "sentence2": datasets.Value("string"),
            "label": datasets.ClassLabel(names=list(LABEL_NAMES)),
            "idx": datasets.Value("int32"),
        }
    )
    return datasets.Dataset.from_dict(records, features=features)


def _integer(path: Path, line: int, column: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{path} line {line} has {column} {value!r} where an integer was expected.") from None


def _label(path: Path, line: int, value: str) -> int:
    label = int(value) if value.strip().isdigit() else -1
    if label not in range(len(LABEL_NAMES)):
        raise ConfigError(f"{path} line {line} has Quality {value!r} where 0 or 1 was expected.")
    return label


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


# -- tokenization --------------------------------------------------------------------------------------


def cache_root(cfg: GlueMrpcConfig) -> Path:
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir).expanduser()
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "app_glue_mrpc"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Digest of what makes the tokenizer produce its ids: vocabulary, normalizer, templates, sides.

    ``name_or_path`` alone is not enough: a local folder can be overwritten with another vocabulary.
    The backend's truncation/padding state is left out: it changes whenever the tokenizer is called,
    and our calls set both explicitly.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:  # a slow (pure Python) tokenizer: its vocabulary is what varies
        spec = sorted(tokenizer.get_vocab().items())
    identity = {
        "class": type(tokenizer).__name__,
        "name_or_path": str(tokenizer.name_or_path),
        "len": len(tokenizer),
        "model_input_names": list(tokenizer.model_input_names),
        "sides": [tokenizer.padding_side, tokenizer.truncation_side],
        "spec": spec,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def cache_key(tokenizer: PreTrainedTokenizerBase, max_length: int, pad_to_max_length: bool, data: str) -> str:
    payload = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "pad_to_max_length": pad_to_max_length,
        "data": data,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def tokenize_split(
    split: Split,
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    pad_to_max_length: bool,
    cache_dir: Path,
    swap: bool = False,
) -> datasets.Dataset:
    """Sentence pairs -> input_ids, attention_mask, (token_type_ids), labels; cached on disk.
    ``swap`` encodes each pair in the other order (sentence2 first).

    The cache file's name is the key, and the key is passed as the new fingerprint: datasets'
    own fingerprint would hash the tokenizer object with dill, which is slow and not stable.
    """
    key = cache_key(tokenizer, max_length, pad_to_max_length, split.fingerprint + ("-swapped" if swap else ""))
    cache_dir.mkdir(parents=True, exist_ok=True)
    encode = functools.partial(_encode, tokenizer=tokenizer, max_length=max_length, pad=pad_to_max_length,
                               swap=swap)
    return split.data.map(
        encode,
        batched=True,
        remove_columns=split.data.column_names,
        new_fingerprint=key,
        cache_file_name=str(cache_dir / f"{name}-{key}.arrow"),
        load_from_cache_file=True,
        desc=f"Tokenizing MRPC {name}",
    )


def _encode(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, max_length: int, pad: bool,
            swap: bool = False) -> dict:
    first, second = ("sentence2", "sentence1") if swap else ("sentence1", "sentence2")
    encoded = tokenizer(
        batch[first],
        batch[second],
        truncation=True,  # longest_first: trims the longer sentence of the pair first
        max_length=max_length,
        padding="max_length" if pad else False,
    )
    encoded = dict(encoded)
    encoded["labels"] = [label if label >= 0 else IGNORE_INDEX for label in batch["label"]]
    return encoded


SWAPPED = "swapped_"
"""Prefix of the columns holding a row's pair in the other order (``symmetric_eval``)."""


def with_swapped_pairs(plain: datasets.Dataset, swapped: datasets.Dataset) -> datasets.Dataset:
    """``plain``'s rows with the same pairs' swapped encoding as ``swapped_*`` columns beside them."""
    import datasets

    extra = swapped.remove_columns("labels")
    extra = extra.rename_columns({name: SWAPPED + name for name in extra.column_names})
    return datasets.concatenate_datasets([plain, extra], axis=1)


def split_swapped(row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A row or batch's own pair, and its swapped pair with the ``swapped_`` prefix removed."""
    plain = {k: v for k, v in row.items() if not k.startswith(SWAPPED)}
    swapped = {k.removeprefix(SWAPPED): v for k, v in row.items() if k.startswith(SWAPPED)}
    return plain, swapped


class PairCollator:
    """Pads rows to the longest in the batch (rows padded at tokenization stay max_length long), or
    to ``fixed_length`` when given (fixed shapes for XLA); swapped pairs, when the rows carry them,
    are padded on their own.

    Returns a plain dict of tensors: BatchEncoding is not a dict subclass, and the engine moves
    batches to devices by walking dicts.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, fixed_length: int | None = None):
        from transformers import DataCollatorWithPadding

        if fixed_length is None:
            self._pad = DataCollatorWithPadding(tokenizer, padding="longest", return_tensors="pt")
        else:
            self._pad = DataCollatorWithPadding(tokenizer, padding="max_length", max_length=fixed_length,
                                                return_tensors="pt")

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if SWAPPED + "input_ids" not in rows[0]:
            return dict(self._pad(rows))
        plain, swapped = zip(*(split_swapped(row) for row in rows))
        batch = dict(self._pad(list(plain)))
        batch.update({SWAPPED + k: v for k, v in self._pad(list(swapped)).items()})
        return batch


# -- hub models and tokenizers --------------------------------------------------------------------------


MAX_UNKNOWN_RATE = 0.05
"""Share of a data sample's tokens that may be the tokenizer's unknown token; above it the tokenizer
does not fit the data (missing vocabulary files, another language) and training would learn nothing."""


def check_tokenizer_covers(tokenizer: PreTrainedTokenizerBase, name: str, train: Any, sample: int = 200) -> None:
    """Refuse a tokenizer that maps much of the first training pairs to its unknown token."""
    unknown = tokenizer.unk_token_id
    if unknown is None:
        return  # byte-level tokenizers encode anything
    rows = train.select(range(min(sample, len(train))))
    ids = tokenizer([*rows["sentence1"], *rows["sentence2"]], add_special_tokens=False)["input_ids"]
    total = sum(len(i) for i in ids)
    rate = sum(i.count(unknown) for i in ids) / max(total, 1)
    if rate > MAX_UNKNOWN_RATE:
        hint = (f"it has only {len(tokenizer)} tokens: are its vocabulary files (vocab.txt, tokenizer.json) missing?"
                if len(tokenizer) <= len(tokenizer.all_special_tokens) + 1
                else "is it the tokenizer the model was trained with?")
        raise ConfigError(f"the tokenizer in {name} encodes {rate:.0%} of the tokens of the first {len(rows)} training "
                          f"pairs as {tokenizer.unk_token}; {hint}")


def check_config_json(name: str) -> None:
    """A local model folder's config.json must parse (else transformers blames the tokenizer)."""
    config = Path(name).expanduser() / "config.json"
    if not config.is_file():
        return
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{config} is not valid JSON ({first}); the model folder's configuration is damaged.") from None


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    check_config_json(name)
    try:
        with hub_access(name):
            return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"Could not load the tokenizer {name!r}, which is neither a local tokenizer folder nor "
            "reachable on the hub; set task.tokenizer (or task.model) to a local folder."
        ) from e


def load_model(name: str, num_labels: int, pooling: Pooling = Pooling.cls) -> nn.Module:
    """The classifier: the model's own head (``cls``) or a mean-pooling head on its encoder.

    A folder exported with the mean-pooling head loads as such whatever ``pooling`` says: the head
    is part of that model.
    """
    from transformers import AutoModel, AutoModelForSequenceClassification

    from app.tasks import mean_pooling

    check_config_json(name)
    labels: dict[str, Any] = {
        "num_labels": num_labels,
        "id2label": dict(enumerate(LABEL_NAMES)),
        "label2id": {label: i for i, label in enumerate(LABEL_NAMES)},
    }
    try:
        with hub_access(name):
            if _model_type(name) == mean_pooling.MeanPoolingConfig.model_type:
                return mean_pooling.MeanPoolingForSequenceClassification.from_pretrained(name, **labels)
            if pooling is Pooling.cls and _trained_with_mean_pooling(name):
                log.info("%s is a sentence-transformers model trained with mean pooling: task.pooling=mean "
                         "usually fine-tunes it better than its [CLS] head.", name)
            if pooling is Pooling.mean:
                encoder = AutoModel.from_pretrained(name)
                return mean_pooling.MeanPoolingForSequenceClassification.from_encoder(encoder, **labels)
            return AutoModelForSequenceClassification.from_pretrained(name, **labels)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"Could not load the model {name!r}, which is neither a local folder with config.json and "
            "weights nor reachable on the hub; set task.model to a local model folder."
        ) from e


def _trained_with_mean_pooling(name: str) -> bool:
    """Does a local sentence-transformers folder say its embeddings are mean-pooled?"""
    for config in Path(name).expanduser().glob("*_Pooling/config.json"):
        try:
            return bool(json.loads(config.read_text(encoding="utf-8")).get("pooling_mode_mean_tokens"))
        except (OSError, ValueError, AttributeError):
            return False
    return False


def _model_type(name: str) -> str | None:
    """``model_type`` from a local folder's config.json (None for hub names and unreadable files)."""
    config = Path(name).expanduser() / "config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def hub_access(name: str) -> Iterator[None]:
    """Hub offline mode for the block when a quick probe finds the hub unreachable.

    Without it, huggingface_hub retries an unreachable hub with backoff for about 25 s per file
    before giving up. Offline mode still serves files already in the local HF cache.
    """
    import datasets.config
    from huggingface_hub import constants

    if (
        Path(name).expanduser().is_dir()
        or constants.HF_HUB_OFFLINE
        or _endpoint_reachable(constants.ENDPOINT)
    ):
        yield
        return
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


@functools.lru_cache(maxsize=8)
def _endpoint_reachable(endpoint: str, timeout_s: float = 3.0) -> bool:
    """Can we open a TCP connection to the hub endpoint (or, behind a proxy, to the proxy)?"""
    import urllib.request

    url = urlparse(endpoint)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy:  # behind a proxy, the proxy is what must answer
        url = urlparse(proxy if "://" in proxy else f"http://{proxy}")
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if host is None:
        return True  # cannot tell: let the libraries try
    reached: list[bool] = []

    def probe() -> None:
        with contextlib.suppress(OSError):
            socket.create_connection((host, port), timeout=timeout_s).close()
            reached.append(True)

    # A thread, because name resolution ignores socket timeouts and can hang on a broken resolver.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s + 1)
    return bool(reached)
