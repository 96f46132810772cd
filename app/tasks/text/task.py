"""``TextClassificationTask``: a Hugging Face encoder on one or two text columns, for any dataset and
for the GLUE presets alike; its loss and metrics follow the problem (one class, a number, several
classes).

Data comes from local files, a GLUE folder or ``datasets.load_dataset`` (``sources``); the columns
are checked and the label set read from the training split (``labels``); splits are tokenized once,
on the main process first, and cached (``tokenization``). A split missing its evaluation part gets
one held out of train. The test split, when there is one, can be predicted after training
(``task.predict_test``), written as the data writes its labels (GLUE's submission format for the
presets).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from app.config import ConfigError
from app.tasks.base import StepOutput, TaskData, TaskRuntime
from app.tasks.splits import stratified_split
from app.tasks.text.batches import PaddingCollator, split_swapped, with_swapped_pairs
from app.tasks.text.config import Pooling, TextClassificationConfig
from app.tasks.text.glue import GLUE_SPECS, TsvLabels
from app.tasks.text.labels import LABEL_COLUMN, LabelSet, check_columns, encode_labels, read_labels
from app.tasks.text.metrics import METRICS, Problem, chosen_metrics, compute, f1_average
from app.tasks.text.models import check_tokenizer_covers, load_model, load_tokenizer
from app.tasks.text.sources import Split, check_local_paths, load_splits
from app.tasks.text.tokenization import cache_root, tokenize_split

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


MAPPING_SHOWN = 12
"""Classes named in the log's label mapping; more are counted."""


def count_at_max_length(data: datasets.Dataset, max_length: int) -> int:
    """Rows whose tokens fill ``max_length`` (the tokenizer cut them there, or they are exactly that long);
    padding (``task.pad_to_max_length``) is not counted."""
    column = "attention_mask" if "attention_mask" in data.column_names else "input_ids"
    return sum(1 for row in data[column] if (sum(row) if column == "attention_mask" else len(row)) >= max_length)


@dataclass
class Rows:
    """A split's texts and encoded targets (``LABEL_COLUMN``), a digest of both (the tokenization
    cache key), and what messages call it."""

    data: datasets.Dataset
    key: str
    origin: str


class TextClassificationTask:
    def __init__(self, cfg: TextClassificationConfig):
        cfg.check()  # also when built from a config that did not pass through app.launching.validate
        self.cfg = cfg
        self.spec = GLUE_SPECS[cfg.glue] if cfg.glue is not None else None
        self.name = cfg.name
        self.title = self.spec.title if self.spec is not None else cfg.name
        """The task in messages and progress bars (``MRPC``)."""
        self.text_fields = tuple(cfg.text_fields)
        suffixes = self.spec.eval_suffixes if self.spec is not None else {"validation": ""}
        if cfg.data_files.train is not None:  # one validation file: the main evaluation set alone
            suffixes = dict(list(suffixes.items())[:1])
        self.eval_suffixes = suffixes
        """Evaluation split -> its metrics' suffix ("": the main evaluation set)."""
        self.test_split = self.spec.test_split if self.spec is not None else "test"
        self.labels: LabelSet | None = None
        """Read from the training split by build_data."""
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._runtime: TaskRuntime | None = None
        self._raw_test: Split | None = None
        self._test_rows: Rows | None = None
        self._test: datasets.Dataset | None = None
        self._held_out = False
        """Whether the evaluation set was held out of train (the data had no evaluation split)."""
        self._splits_read: list[str] = []
        self._cut: list[str] = []
        """What build_data read (``train: 200 rows of train.csv``) and cut (rows at task.max_length): the log's."""

    # The tokenizer is loaded on first use: build_data, save_artifacts and the tests all need it,
    # and building the task (e.g. to validate a config) should not touch the disk or network.
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.tokenizer or self.cfg.model)
        return self._tokenizer

    @property
    def problem(self) -> Problem | None:
        """The problem: the config's, or the label column's once build_data has read it."""
        return self.labels.problem if self.labels is not None else self.cfg.problem

    @property
    def metric_names(self) -> tuple[str, ...]:
        """loss and the chosen metrics, of each evaluation set; before the data says which problem
        it is (task.problem=null), those of every problem the metrics could be."""
        problems = [self.problem] if self.problem is not None else list(Problem)
        names = ["loss"]
        for problem in problems:
            names += [m for m in chosen_metrics(problem, self.cfg.metrics) if m in METRICS[problem] and m not in names]
        return tuple(f"{name}_{suffix}" if suffix else name for suffix in self.eval_suffixes.values() for name in names)

    # -- data ----------------------------------------------------------------------------------------------

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        self._runtime = runtime
        # The label set goes into every checkpoint: a resumed run must read the same one from its data.
        runtime.register_for_checkpointing(LabelState(self))
        check_local_paths(self.cfg)  # fail on every process alike, before any barrier
        if not runtime.is_main_process:
            import datasets

            # Reading and tokenizing show their progress ("Tokenizing MRPC train") once, from the main process.
            datasets.disable_progress_bars()
        train, evaluations = run_main_first(runtime, self._load_and_tokenize)
        if self.cfg.predict_test and self._test_rows is None:
            raise ConfigError(f"task.predict_test=true needs a test split, and the {self.title} data has none.")
        lengths = [len(ids) for ids in train["input_ids"]]
        self._cut = [f"{count_at_max_length(data, self.cfg.max_length):,} {name}" for name, data in
                     (("training", train), *((f"evaluation{' ' + s if s else ''}", d) for s, d in evaluations.items()))]
        # A compiling backend (XLA) builds one program per shape: every batch then has max_length tokens.
        fixed_length = self.cfg.max_length if runtime.static_shapes else None
        return TaskData(train=train, eval=evaluations[""], collate_fn=PaddingCollator(self.tokenizer, fixed_length),
                        train_lengths=lengths, extra_eval={s: d for s, d in evaluations.items() if s})

    def _load_and_tokenize(self) -> tuple[datasets.Dataset, dict[str, datasets.Dataset]]:
        """Every split read and checked, then tokenized: bad data is refused before anything is cached."""
        cfg = self.cfg
        raw = load_splits(cfg, self.spec, list(self.eval_suffixes), self.test_split,
                          cache_root(cfg.cache_dir, cfg.name) / "raw")
        train = raw["train"]
        check_columns(train, self.text_fields, cfg.label_field)
        self.labels = read_labels(train, cfg.label_field, cfg.problem,
                                  self.spec.label_names if self.spec is not None else None)
        self._check_labels_fit(train)
        train_rows = self._rows(train, labeled=True, train_origin=train.origin)
        evaluations: dict[str, Rows] = {}
        for split, suffix in self.eval_suffixes.items():
            if split in raw:
                check_columns(raw[split], self.text_fields, cfg.label_field)
                evaluations[suffix] = self._rows(raw[split], labeled=True, train_origin=train.origin)
            elif suffix:  # a further evaluation set's metrics are promised by metric_names: MNLI's mismatched
                raise ConfigError(f"the {self.title} data has no {split} split, whose metrics (eval/*_{suffix}) the "
                                  "task reports.")
        if "" not in evaluations:
            train_rows, evaluations[""] = self._hold_out(train_rows)
            self._held_out = True
        self._splits_read = [f"train: {len(train_rows.data):,} rows of {train_rows.origin}"] + [
            f"evaluation{' ' + suffix if suffix else ''}: {len(rows.data):,} rows of {rows.origin}"
            for suffix, rows in evaluations.items()]
        test = raw.get(self.test_split)
        if test is not None:
            check_columns(test, self.text_fields, None)  # its labels, if it has any, are not read
            self._raw_test = test
            self._test_rows = self._rows(test, labeled=False, train_origin=train.origin)
            self._splits_read.append(f"test: {len(self._test_rows.data):,} rows of {test.origin}")
        check_tokenizer_covers(self.tokenizer, cfg.tokenizer or cfg.model, train.data, self.text_fields)
        tokenized_train = self._tokenize(train_rows, "train")
        if cfg.swap_pairs:
            import datasets

            tokenized_train = datasets.concatenate_datasets([tokenized_train, self._tokenize(train_rows, "train",
                                                                                             swap=True)])
        names = {suffix: split for split, suffix in self.eval_suffixes.items()}
        return tokenized_train, {suffix: self._tokenize_eval(rows, names.get(suffix, "validation"))
                                 for suffix, rows in evaluations.items()}

    def _check_labels_fit(self, train: Split) -> None:
        """The config's choices that depend on the problem and label set the data turned out to have."""
        labels, cfg = self.labels, self.cfg
        assert labels is not None
        if labels.problem is not Problem.single_label and cfg.label_smoothing:
            raise ConfigError(f"task.label_smoothing applies to single_label problems only, and {train.origin}'s "
                              f"labels make a {labels.problem.value} problem.")
        for name in cfg.metrics or []:
            if name not in METRICS[labels.problem]:
                raise ConfigError(f"task.metrics has {name!r}, which is not a metric of {labels.problem.value} problems "
                                  f"(the labels of {train.origin}); choose from {', '.join(METRICS[labels.problem])}.")
        if cfg.f1_average is not None and cfg.f1_average.value == "binary" and len(labels.names) != 2:
            raise ConfigError(f"task.f1_average=binary needs two classes, and {train.origin} has {len(labels.names)}.")

    def _rows(self, split: Split, labeled: bool, train_origin: str) -> Rows:
        assert self.labels is not None
        targets = encode_labels(split, self.labels, self.cfg.label_field if labeled else None, train_origin)
        encoding = json.dumps({"text": self.text_fields, "label": self.cfg.label_field if labeled else None,
                               **self.labels.state_dict()}, sort_keys=True)
        key = digest(split.fingerprint, encoding)
        data = split.data.select_columns(list(self.text_fields)).add_column(LABEL_COLUMN, targets, new_fingerprint=key)
        return Rows(data, key, split.origin)

    def _hold_out(self, rows: Rows) -> tuple[Rows, Rows]:
        """No evaluation split: ``task.eval_fraction`` of train, seeded; stratified by class for single_label."""
        import numpy as np

        cfg = self.cfg
        n = len(rows.data)
        if n < 2:
            raise ConfigError(f"{rows.origin} has {n} row, too few to hold out an evaluation set; give "
                              "task.data_files.validation.")
        if self.problem is Problem.single_label:
            kept, held = stratified_split(np.asarray(rows.data[LABEL_COLUMN]), cfg.eval_fraction, cfg.split_seed)
        else:
            order = np.random.RandomState(cfg.split_seed).permutation(n)
            cut = math.ceil(cfg.eval_fraction * n)
            held, kept = order[:cut], order[cut:]
        tag = f"held-out-{cfg.eval_fraction}-{cfg.split_seed}"
        return (Rows(rows.data.select(kept), digest(rows.key, tag, "train"), rows.origin),
                Rows(rows.data.select(held), digest(rows.key, tag, "eval"), f"{rows.origin} (held out)"))

    def _tokenize(self, rows: Rows, name: str, swap: bool = False) -> datasets.Dataset:
        cfg = self.cfg
        return tokenize_split(rows.data, rows.key, name, self.text_fields, self.tokenizer, cfg.max_length,
                              cfg.pad_to_max_length, cache_root(cfg.cache_dir, cfg.name), self.title, swap=swap)

    def _tokenize_eval(self, rows: Rows, name: str) -> datasets.Dataset:
        """Evaluation and test rows: the pair, and with ``symmetric_eval`` the swapped pair beside it."""
        plain = self._tokenize(rows, name)
        if not self.cfg.symmetric_eval:
            return plain
        return with_swapped_pairs(plain, self._tokenize(rows, name, swap=True))

    # -- model ---------------------------------------------------------------------------------------------

    def label_set(self) -> LabelSet:
        """The labels build_data read; a GLUE preset's are known before (its spec fixes them)."""
        if self.labels is not None:
            return self.labels
        if self.spec is not None:
            if self.spec.label_names is None:
                return LabelSet(Problem.regression, (self.cfg.label_field,))
            return LabelSet(Problem.single_label, self.spec.label_names, self.spec.label_names)
        raise RuntimeError("build_data() reads the label set from the training split; call it before build_model().")

    def build_model(self) -> nn.Module:
        return load_model(self.cfg.model, self.label_set(), self.cfg.pooling)

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Per-sample losses, averaged by the engine over the optimizer step's items: samples, or for
        multi_label each sample's label cells (one binary decision each, as a mean over cells weighs them)."""
        logits = self.predict(model, batch)
        labels = batch["labels"]
        problem = self.label_set().problem
        items = 1
        if problem is Problem.regression:
            losses = F.mse_loss(logits.float().squeeze(-1), labels.float(), reduction="none")
        elif problem is Problem.multi_label:
            cells = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
            losses, items = cells.sum(dim=-1), cells.shape[-1]
        else:
            # Smoothing regularises training; evaluation keeps the plain loss so eval/loss compares across runs.
            smoothing = self.cfg.label_smoothing if model.training else 0.0
            losses = F.cross_entropy(logits.float(), labels, label_smoothing=smoothing, reduction="none")
        return StepOutput(sample_losses=losses, sample_items=items, logits=logits, labels=labels)

    def tokens_in_batch(self, batch: Any) -> torch.Tensor:
        """The batch's non-padding tokens (``CountsTokens``): its attention mask's sum, on its device
        (a tokenizer that makes no mask: the input ids that are not padding)."""
        mask = batch.get("attention_mask")
        return mask.sum() if mask is not None else batch["input_ids"].ne(self.tokenizer.pad_token_id).sum()

    def predict(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The model's outputs (logits; a regression's values): unlike ``step`` it needs no gold labels.

        A batch that also carries the swapped pairs (``symmetric_eval``: evaluation and test rows,
        never training rows) is scored in both orders and the two combined: the mean of the
        log-probabilities of one class (argmax, softmax and cross-entropy read it as a two-view
        ensemble), else the mean of the two outputs.
        """
        inputs, swapped = split_swapped(batch)
        inputs.pop("labels", None)
        logits = model(**inputs).logits
        if not swapped:
            return logits
        other = model(**swapped).logits
        if self.label_set().problem is Problem.single_label:
            return (logits.float().log_softmax(dim=-1) + other.float().log_softmax(dim=-1)) / 2
        return (logits.float() + other.float()) / 2

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        labels_set = self.label_set()
        average = f1_average(self.cfg.f1_average, len(labels_set.names))
        return compute(labels_set.problem, chosen_metrics(labels_set.problem, self.cfg.metrics), logits, labels,
                       average)

    def save_artifacts(self, model: nn.Module, folder: Path) -> None:
        """Tokenizer files and config.json (with the label names as ``id2label``/``label2id``), so that
        from_pretrained(folder) works once the weights are there."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        from app.tasks.text import mean_pooling

        self.tokenizer.save_pretrained(folder)
        config: Any = model.config
        config.architectures = [type(model).__name__]
        if isinstance(model, mean_pooling.MeanPoolingForSequenceClassification):
            # The model's code travels with it: the Auto classes load it with trust_remote_code=True.
            config.auto_map = mean_pooling.auto_map()
            shutil.copyfile(mean_pooling.__file__, folder / mean_pooling.MODULE_FILE)
        config.save_pretrained(folder)

    def data_summary(self) -> list[str]:
        """The splits read, the labels' ids, the rows cut at task.max_length (app.tasks.base.DescribesData)."""
        labels = self.label_set()
        if labels.problem is Problem.regression:
            mapping = f"a number per row ({self.cfg.label_field}, regression)"
        else:
            shown = ", ".join(f"{name}={i}" for i, name in enumerate(labels.names[:MAPPING_SHOWN]))
            more = f", … ({len(labels.names)} classes)" if len(labels.names) > MAPPING_SHOWN else ""
            mapping = f"labels {shown}{more}" + (" (multi-label)" if labels.problem is Problem.multi_label else "")
        swapped = ["task.swap_pairs: each training pair also in the other order"] if self.cfg.swap_pairs else []
        cut = f"rows cut at task.max_length={self.cfg.max_length} tokens: {', '.join(self._cut)}"
        return [*self._splits_read, mapping, *swapped, cut]

    def card_facts(self) -> dict[str, str]:
        """What the model card says of the model and the data (app.tasks.base.DescribesItself)."""
        cfg = self.cfg
        head = "a linear head on the mean token state (task.pooling=mean)" if cfg.pooling is Pooling.mean \
            else "its own sequence-classification head"
        labels = self.label_set()
        if cfg.data_files.train is not None:
            files = {"train": cfg.data_files.train, "validation": cfg.data_files.validation, "test": cfg.data_files.test}
            data = "Files: " + ", ".join(f"{split} `{path}`" for split, path in files.items() if path)
        elif cfg.data_dir is not None:
            data = f"The {self.title} files in `{cfg.data_dir}`"
        else:
            data = f"`datasets.load_dataset({cfg.dataset!r}" + (f", {cfg.dataset_config!r}" if cfg.dataset_config else "") + ")`"
        if self._held_out:
            data += f"; {cfg.eval_fraction:.0%} of train held out for evaluation (task.split_seed={cfg.split_seed})"
        columns = " and ".join(f"`{c}`" for c in self.text_fields)
        return {"title": f"{self.title}, {cfg.model}",
                "base model": f"`{cfg.model}`" + (f" (tokenizer `{cfg.tokenizer}`)" if cfg.tokenizer else "") + f", {head}",
                "labels": f"{labels.problem.value}: " + ", ".join(str(n) for n in labels.names),
                "input": f"{columns}, at most {cfg.max_length} tokens",
                "data": data + "."}

    # -- test split (cfg.predict_test) ---------------------------------------------------------------------

    def test_dataset(self) -> datasets.Dataset:
        """The tokenized test split, in file order; its targets are placeholders (-100 for classes)."""
        if self._test is None:
            rows = self._test_rows
            if rows is None:
                raise ConfigError(f"There is no {self.title} test split to predict on (build_data has not found one).")
            self._test = run_main_first(self._runtime, lambda: self._tokenize_eval(rows, "test"))
        return self._test

    def write_predictions(self, outputs: torch.Tensor, path: str | Path) -> None:
        """A header, then ``index<TAB>prediction`` per test row, in order: the class as the training data
        writes it (GLUE: the label ids, or names for MNLI, QNLI and RTE), the number, or the classes
        whose sigmoid exceeds 0.5, comma-separated."""
        labels = self.label_set()
        raw = self._raw_test.data if self._raw_test is not None else None
        index = list(raw["idx"]) if raw is not None and "idx" in raw.column_names else list(range(len(outputs)))
        if len(index) != len(outputs):
            raise ValueError(f"got {len(outputs)} predictions for {len(index)} test rows")
        if labels.problem is Problem.regression:
            predictions = [f"{v:.6g}" for v in outputs.float().squeeze(-1).tolist()]
        elif labels.problem is Problem.multi_label:
            predictions = [",".join(str(labels.spellings[i]) for i, hot in enumerate(row) if hot)
                           for row in (outputs > 0).tolist()]
        else:
            ids_only = self.spec is not None and self.spec.tsv_labels is TsvLabels.ids
            predictions = [str(i if ids_only else labels.spellings[i]) for i in outputs.argmax(dim=-1).tolist()]
        lines = ["index\tprediction"] + [f"{i}\t{p}" for i, p in zip(index, predictions)]
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


class LabelState:
    """The label set as checkpoint state: a resumed run, or ``mode=eval`` of a checkpoint, refuses a
    training split that now gives other labels (the weights' outputs would mean other classes)."""

    def __init__(self, task: TextClassificationTask):
        self.task = task

    def state_dict(self) -> dict[str, Any]:
        return self.task.label_set().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ours = self.state_dict()
        if state != ours:
            raise ConfigError(f"the checkpoint was trained on the {state.get('problem')} labels "
                              f"{', '.join(map(str, state.get('labels', [])))}, and the training data now gives "
                              f"{', '.join(ours['labels'])}; resume with the data it was trained on.")


def digest(*parts: str) -> str:
    """A short digest of ``parts`` (datasets' fingerprints are at most 64 characters)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def run_main_first(runtime: TaskRuntime | None, work: Callable[[], T]) -> T:
    """Run ``work`` on the main process first (it fills the caches), then on the others.

    A ConfigError is raised only after the block: raised inside, the main process would skip the
    barrier that the others wait on, and they would hang until the collective timeout.
    """
    error: ConfigError | None = None
    # No runtime (the test split asked for before build_data): one process, nothing to order.
    with runtime.main_process_first() if runtime is not None else contextlib.nullcontext():
        try:
            result = work()
        except ConfigError as e:
            error = e
    if error is not None:
        raise error
    return result

