"""``GlueTask``: a GLUE classification task for any spec. A Hugging Face encoder; loss, accuracy, F1.

Data comes from the hub (``datasets.load_dataset(cfg.hub_dataset, spec.config)``) or from
``cfg.data_dir`` (``sources``); splits are tokenized once, on the main process first, and cached
(``tokenization``). The test split, when there is one, can be predicted after training
(``task.predict_test``) in GLUE's submission format.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import StepOutput, TaskData, TaskRuntime
from app.tasks.glue.batches import SWAPPED, PaddingCollator, split_swapped
from app.tasks.glue.config import GlueConfig
from app.tasks.glue.models import check_tokenizer_covers, load_model, load_tokenizer
from app.tasks.glue.sources import Split, load_splits, local_root
from app.tasks.glue.tokenization import cache_root, tokenize_split
from app.tasks.metrics import classification_metrics

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


class GlueTask:
    metric_names: tuple[str, ...] = ("loss", "accuracy", "f1")

    def __init__(self, cfg: GlueConfig):
        cfg.check()  # also when built from a config that did not pass through app.configure.validate
        self.cfg = cfg
        self.spec = cfg.spec
        self.name = self.spec.name
        self.num_labels = len(self.spec.label_names)
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._runtime: TaskRuntime | None = None
        self._raw_test: Split | None = None
        self._test: datasets.Dataset | None = None

    # The tokenizer is loaded on first use: build_data, save_artifacts and the tests all need it,
    # and building the task (e.g. to validate a config) should not touch the disk or network.
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.tokenizer or self.cfg.model)
        return self._tokenizer

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        self._runtime = runtime
        if self.cfg.data_dir is not None:
            local_root(self.cfg.data_dir)  # fail on every process alike, before any barrier
        if not runtime.is_main_process:
            import datasets

            # Tokenization shows its progress ("Tokenizing MRPC train") once, from the main process.
            datasets.disable_progress_bars()
        splits = run_main_first(runtime, self._load_and_tokenize)
        train, validation, self._raw_test = splits
        if self.cfg.predict_test and self._raw_test is None:
            raise ConfigError(f"task.predict_test=true needs a test split, and the {self.spec.title} data has none.")
        lengths = [len(ids) for ids in train["input_ids"]]
        # A compiling backend (XLA) builds one program per shape: every batch then has max_length tokens.
        fixed_length = self.cfg.max_length if runtime.static_shapes else None
        return TaskData(train=train, eval=validation, collate_fn=PaddingCollator(self.tokenizer, fixed_length),
                        train_lengths=lengths)

    def _load_and_tokenize(self) -> tuple[datasets.Dataset, datasets.Dataset, Split | None]:
        raw = load_splits(self.cfg, self.spec)
        check_tokenizer_covers(self.tokenizer, self.cfg.tokenizer or self.cfg.model, raw["train"].data, self.spec)
        train = self._tokenize_train(raw["train"])
        validation = self._tokenize_eval(raw["validation"], "validation")
        return train, validation, raw.get("test")

    def _tokenize(self, split: Split, name: str, swap: bool = False) -> datasets.Dataset:
        cfg = self.cfg
        return tokenize_split(split, name, self.spec, self.tokenizer, cfg.max_length, cfg.pad_to_max_length,
                              cache_root(cfg, self.spec), swap=swap)

    def _tokenize_train(self, split: Split) -> datasets.Dataset:
        """The training rows (a task may add more views of them: MRPC's ``swap_pairs``)."""
        return self._tokenize(split, "train")

    def _tokenize_eval(self, split: Split, name: str) -> datasets.Dataset:
        """Evaluation and test rows (a task may give each a second view: MRPC's ``symmetric_eval``)."""
        return self._tokenize(split, name)

    def build_model(self) -> nn.Module:
        return load_model(self.cfg.model, self.spec.label_names, self.cfg.pooling)

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
        # Two labels: F1 of label 1 (GLUE's F1 for MRPC and QQP); more: the mean over labels.
        return classification_metrics(logits, labels, f1_average="binary" if self.num_labels == 2 else "macro")

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
                raise ConfigError(f"There is no {self.spec.title} test split to predict on (build_data has not "
                                  "found one).")
            raw_test = self._raw_test
            self._test = run_main_first(self._runtime, lambda: self._tokenize_eval(raw_test, "test"))
        return self._test

    def write_predictions(self, preds: Iterable[int], path: str | Path) -> None:
        """GLUE submission format: a header, then ``index<TAB>prediction`` per test row, in order."""
        preds = [int(p) for p in preds]
        index = list(self._raw_test.data["idx"]) if self._raw_test is not None else list(range(len(preds)))
        if len(index) != len(preds):
            raise ValueError(f"got {len(preds)} predictions for {len(index)} test rows")
        lines = ["index\tprediction"] + [f"{i}\t{p}" for i, p in zip(index, preds)]
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


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
