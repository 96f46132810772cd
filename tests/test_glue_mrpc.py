"""GLUE MRPC task: data layouts, error messages, tokenization cache, padding, a training step, export."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch

from app.config import ConfigError
from app.tasks import build_task
from app.tasks.text.config import Pooling, TextClassificationConfig
from app.tasks.text.glue import GLUE_SPECS, GlueName
from app.tasks.text.sources import load_glue_folder
from app.tasks.text.task import TextClassificationTask
from app.tasks.text.tokenization import IGNORE_INDEX
from app.tasks.text.tsv import read_glue_tsv
from tests.helpers.tiny_bert import (
    FakeRuntime,
    make_tiny_bert,
    make_tiny_glue_tsv,
    mrpc_config,
    synthetic_pairs,
    write_glue_tsv,
)

REAL_DATA = Path(__file__).resolve().parents[2] / "shared/data/glue_mrpc"
MRPC = GLUE_SPECS[GlueName.mrpc]


def one_sentence(message: str) -> bool:
    return message.endswith(".") and ". " not in message and "\n" not in message


# -- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch, tmp_path_factory):
    """No test may reach the network or write to ~/.cache."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # The libraries read these at import; the modules' attributes are what they consult at call time.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(
        datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets")
    )


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_tiny_glue_tsv(tmp_path_factory.mktemp("mrpc_tsv"), n_train=48, n_val=16, n_test=8)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    sentences = [s for _, s1, s2 in synthetic_pairs(200, seed=9) for s in (s1, s2)]
    return make_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), sentences)


@pytest.fixture
def make_cfg(tiny_data, tiny_model, tmp_path):
    def make(**overrides) -> TextClassificationConfig:
        values = {"model": str(tiny_model), "data_dir": str(tiny_data), "cache_dir": str(tmp_path / "cache")}
        return mrpc_config(**{**values, **overrides})

    return make


def lengths(ds) -> list[int]:
    return [len(ids) for ids in ds["input_ids"]]


# -- raw data ------------------------------------------------------------------------------------------


def test_build_task_is_lazy():
    task = build_task(mrpc_config())  # the default hub model: nothing may be fetched yet
    assert isinstance(task, TextClassificationTask)
    assert task._tokenizer is None


def test_app_tasks_does_not_import_transformers():
    code = "import sys, app.tasks; sys.exit('transformers' in sys.modules or 'datasets' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], check=False, cwd=Path(__file__).parents[1]).returncode
        == 0
    )


def test_tsv_loading_keeps_unquoted_double_quotes(tiny_data):
    splits = load_glue_folder(str(tiny_data), MRPC)
    assert {name: len(s.data) for name, s in splits.items()} == {"train": 48, "validation": 16, "test": 8}
    train = splits["train"].data
    expected = synthetic_pairs(48, seed=1)
    assert train["sentence1"] == [s1 for _, s1, _ in expected]
    assert train["sentence2"] == [s2 for _, _, s2 in expected]
    assert train["label"] == [label for label, _, _ in expected]
    assert train["idx"] == list(range(48))
    assert any(s.count('"') % 2 == 1 for s in train["sentence1"])  # an unbalanced quote survived
    assert isinstance(train, datasets.Dataset)


def test_dev_tsv_is_the_validation_split(tmp_path):
    make_tiny_glue_tsv(tmp_path, n_train=4, n_val=3, validation_name="dev.tsv")
    splits = load_glue_folder(str(tmp_path), MRPC)
    assert len(splits["validation"].data) == 3 and "test" not in splits


def test_glue_test_tsv_without_labels(tmp_path):
    path = tmp_path / "test.tsv"
    path.write_text('index\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1\t2\tHe said "yes.\tShe said no.\n')
    ds = read_glue_tsv(path, MRPC)
    assert ds[0] == {"sentence1": 'He said "yes.', "sentence2": "She said no.", "label": -1, "idx": 0}


@pytest.mark.parametrize(
    "pattern", ["mrpc/{split}-00000-of-00001.parquet", "{split}-00000-of-00001.parquet", "{split}.parquet"]
)
def test_parquet_layouts(tiny_data, tmp_path, pattern):
    for split in ("train", "validation", "test"):
        target = tmp_path / pattern.format(split=split)
        target.parent.mkdir(parents=True, exist_ok=True)
        read_glue_tsv(tiny_data / f"{split}.tsv", MRPC).to_parquet(str(target))
    splits = load_glue_folder(str(tmp_path), MRPC)
    assert {name: len(s.data) for name, s in splits.items()} == {"train": 48, "validation": 16, "test": 8}
    assert splits["train"].data["sentence1"] == read_glue_tsv(tiny_data / "train.tsv", MRPC)["sentence1"]


def test_save_to_disk_layout(tiny_data, tmp_path):
    splits = {s: read_glue_tsv(tiny_data / f"{s}.tsv", MRPC) for s in ("train", "validation")}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    loaded = load_glue_folder(str(tmp_path / "saved"), MRPC)
    assert len(loaded["train"].data) == 48 and len(loaded["validation"].data) == 16


def test_hub_unreachable_is_one_sentence(make_cfg):
    task = TextClassificationTask(make_cfg(data_dir=None))
    with pytest.raises(ConfigError) as info:
        task.build_data(FakeRuntime())
    message = str(info.value)
    assert one_sentence(message) and "task.data_dir=" in message and "nyu-mll/glue" in message


def test_hub_probe_fails_fast_without_offline_env(make_cfg, monkeypatch):
    """No offline variables set, no network: the probe switches to offline mode instead of ~25 s of retries."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="task.data_dir="):
        TextClassificationTask(make_cfg(data_dir=None)).build_data(FakeRuntime())
    assert time.monotonic() - start < 15
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False  # offline mode was only for the block


def test_missing_data_dir(make_cfg, tmp_path):
    with pytest.raises(ConfigError) as info:
        TextClassificationTask(make_cfg(data_dir=str(tmp_path / "nope"))).build_data(FakeRuntime())
    assert one_sentence(str(info.value)) and "task.data_dir=" in str(info.value)


def test_data_dir_without_splits(make_cfg, tmp_path):
    write_glue_tsv(tmp_path / "train.tsv", synthetic_pairs(3))  # no validation.tsv / dev.tsv
    with pytest.raises(ConfigError) as info:
        TextClassificationTask(make_cfg(data_dir=str(tmp_path))).build_data(FakeRuntime())
    assert one_sentence(str(info.value)) and "validation" in str(info.value)


def test_missing_model_and_tokenizer(make_cfg, tmp_path):
    task = TextClassificationTask(make_cfg(model=str(tmp_path / "no_model")))
    with pytest.raises(ConfigError) as info:
        task.build_model()
    assert one_sentence(str(info.value)) and "task.model" in str(info.value)
    with pytest.raises(ConfigError, match="task.tokenizer"):
        _ = task.tokenizer


def test_unreachable_hub_model(make_cfg):
    with pytest.raises(ConfigError, match="task.model"):
        TextClassificationTask(make_cfg(model="bert-base-cased")).build_model()


# -- tokenization and batches --------------------------------------------------------------------------


def test_truncates_at_max_length(make_cfg):
    runtime = FakeRuntime()
    data = TextClassificationTask(make_cfg(max_length=32)).build_data(runtime)
    assert runtime.entered == 1
    assert max(lengths(data.train)) == 32 and min(lengths(data.train)) < 32
    assert data.train_lengths == lengths(data.train)  # what trainer.group_by_length groups by
    assert set(data.train.column_names) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert len(data.eval) == 16


def test_dynamic_padding_pads_to_longest_in_batch(make_cfg):
    data = TextClassificationTask(make_cfg(max_length=128)).build_data(FakeRuntime())
    rows = [data.train[i] for i in range(8)]
    batch = data.collate_fn(rows)
    longest = max(len(r["input_ids"]) for r in rows)
    assert type(batch) is dict
    assert batch["input_ids"].shape == (8, longest) and longest < 128
    assert len({len(r["input_ids"]) for r in rows}) > 1  # there was something to pad
    assert batch["attention_mask"].sum(dim=1).tolist() == [len(r["input_ids"]) for r in rows]
    assert batch["labels"].dtype == torch.long and batch["labels"].tolist() == [r["labels"] for r in rows]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("fixed_length", [None, 64])
def test_collator_gives_what_transformers_collator_gives(make_cfg, side, fixed_length):
    """Our numpy padding (the fast path) against DataCollatorWithPadding, the reference it replaces:
    the same keys, dtypes and values, for both views of symmetric evaluation rows; a row with a column
    the fast path does not know goes through the reference itself."""
    from transformers import DataCollatorWithPadding

    from app.tasks.text.batches import PaddingCollator, split_swapped

    task = TextClassificationTask(make_cfg(max_length=64, symmetric_eval=True))
    data = task.build_data(FakeRuntime())
    task.tokenizer.padding_side = side
    padding = {"padding": "longest"} if fixed_length is None else {"padding": "max_length", "max_length": fixed_length}
    reference = DataCollatorWithPadding(task.tokenizer, return_tensors="pt", **padding)
    ours = PaddingCollator(task.tokenizer, fixed_length)
    rows = [data.eval[i] for i in range(8)]
    assert len({len(r["input_ids"]) for r in rows}) > 1  # there is something to pad
    plain, swapped = (list(view) for view in zip(*(split_swapped(r) for r in rows)))
    expected = {**reference(plain), **{"swapped_" + k: v for k, v in reference(swapped).items()}}
    batch = ours(rows)
    assert list(batch) == list(expected)
    for key, tensor in expected.items():
        assert batch[key].dtype == tensor.dtype and torch.equal(batch[key], tensor), key
    with_extra = [{**r, "special_tokens_mask": [0] * len(r["input_ids"]), "idx": i}
                  for i, r in enumerate(plain)]
    slow = ours(with_extra)
    for key, tensor in reference(with_extra).items():
        assert torch.equal(slow[key], tensor), key


def test_swap_pairs_adds_every_training_pair_in_the_other_order(make_cfg):
    plain = TextClassificationTask(make_cfg(max_length=128)).build_data(FakeRuntime())
    task = TextClassificationTask(make_cfg(max_length=128, swap_pairs=True))
    data = task.build_data(FakeRuntime())
    n = len(plain.train)
    assert len(data.train) == 2 * n and len(data.train_lengths) == 2 * n
    assert len(data.eval) == len(plain.eval)  # evaluation is not augmented
    cls, sep = task.tokenizer.cls_token_id, task.tokenizer.sep_token_id
    for i in (0, 5, n - 1):
        original, swapped = data.train[i], data.train[n + i]
        assert original["input_ids"] == plain.train[i]["input_ids"]
        assert swapped["labels"] == original["labels"]
        ids = original["input_ids"]  # [CLS] first [SEP] second [SEP] (no truncation at 128)
        middle = ids.index(sep)
        first, second = ids[1:middle], ids[middle + 1:-1]
        assert swapped["input_ids"] == [cls, *second, sep, *first, sep]
        assert swapped["token_type_ids"] == [0] * (len(second) + 2) + [1] * (len(first) + 1)


def test_pad_to_max_length_gives_fixed_shapes(make_cfg):
    data = TextClassificationTask(make_cfg(max_length=48, pad_to_max_length=True)).build_data(FakeRuntime())
    assert set(lengths(data.train)) == {48}
    assert data.collate_fn([data.eval[i] for i in range(3)])["input_ids"].shape == (3, 48)


def test_cache_is_keyed_on_max_length_and_tokenizer(make_cfg, tiny_data, tmp_path):
    def train_split(**overrides):
        return TextClassificationTask(make_cfg(**overrides)).build_data(FakeRuntime()).train

    def cache_file(ds) -> Path:
        (entry,) = ds.cache_files
        return Path(entry["filename"])

    short, longer = train_split(max_length=16), train_split(max_length=24)
    assert max(lengths(short)) == 16 and max(lengths(longer)) == 24  # no stale reuse
    assert cache_file(short) != cache_file(longer)
    assert cache_file(short).parent == tmp_path / "cache"

    stamp = cache_file(short).stat().st_mtime_ns
    again = train_split(max_length=16)  # same settings: read back, not rewritten
    assert cache_file(again) == cache_file(short) and cache_file(again).stat().st_mtime_ns == stamp
    assert again["input_ids"] == short["input_ids"]

    # Another vocabulary written to the same folder must not hit the first one's cache.
    # (Trained on text like the data's, so it encodes it: one that cannot is refused, see below.)
    other = make_tiny_bert(tmp_path / "other_bert", [s for _, s1, s2 in synthetic_pairs(30, seed=3) for s in (s1, s2)],
                           vocab_size=60)
    retrained = train_split(max_length=16, model=str(other))
    assert cache_file(retrained) != cache_file(short)
    assert retrained["input_ids"] != short["input_ids"]


# -- model ---------------------------------------------------------------------------------------------


def test_training_step_and_metrics(make_cfg):
    task = TextClassificationTask(make_cfg(max_length=32))
    data = task.build_data(FakeRuntime())
    model = task.build_model()
    loader = torch.utils.data.DataLoader(data.train, batch_size=8, collate_fn=data.collate_fn)
    batch = next(iter(loader))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.eval()  # no dropout: the loss on the one batch then falls step by step, whatever the init
    losses = []
    for _ in range(15):  # a few steps on one batch: the tiny model must be able to fit it
        out = task.step(model, batch)
        assert out.logits.shape == (8, 2) and out.labels is batch["labels"] and out.mean_loss().dim() == 0
        optimizer.zero_grad()
        out.mean_loss().backward()
        optimizer.step()
        losses.append(out.mean_loss().item())
    assert losses[-1] < losses[0]

    model.eval()
    eval_loader = torch.utils.data.DataLoader(data.eval, batch_size=5, collate_fn=data.collate_fn)
    with torch.no_grad():
        outs = [task.step(model, b) for b in eval_loader]
    metrics = task.compute_metrics(torch.cat([o.logits for o in outs]), torch.cat([o.labels for o in outs]))
    assert set(metrics) == {"loss", "accuracy", "f1"}
    assert 0 <= metrics["accuracy"] <= 1 and 0 <= metrics["f1"] <= 1 and metrics["loss"] > 0


def test_label_smoothing_changes_the_training_loss_only(make_cfg):
    plain_task = TextClassificationTask(make_cfg(max_length=32))
    smooth_task = TextClassificationTask(make_cfg(max_length=32, label_smoothing=0.2))
    data = plain_task.build_data(FakeRuntime())
    batch = next(iter(torch.utils.data.DataLoader(data.train, batch_size=8, collate_fn=data.collate_fn)))
    model = plain_task.build_model()
    model.eval()  # the same forward for every call: no dropout
    # A freshly initialised tiny model can give every pair the same logits; with those, smoothing
    # leaves the mean loss unchanged when p = 0.5 or when the batch holds as many 0s as 1s. A biased
    # head and a batch of one class make the two losses differ whatever the initialisation.
    batch["labels"] = torch.ones_like(batch["labels"])
    with torch.no_grad():
        model.classifier.bias.copy_(torch.tensor([1.5, -1.5]))
        plain = plain_task.step(model, batch)
        assert smooth_task.step(model, batch).mean_loss().item() == pytest.approx(plain.mean_loss().item())  # eval: plain
        model.training = True  # the task sees training mode; the dropout layers stay off
        smooth = smooth_task.step(model, batch)
    labels = batch["labels"]
    log_p = torch.log_softmax(plain.logits.float(), dim=-1)
    # Target 0.9 on the gold class, 0.1 on the other: -(0.8 log p_gold + 0.1 (log p_0 + log p_1)).
    expected = -(0.8 * log_p.gather(1, labels[:, None]).squeeze(1) + 0.1 * log_p.sum(dim=1)).mean()
    assert smooth.mean_loss().item() == pytest.approx(expected.item(), rel=1e-5)
    assert smooth.mean_loss().item() != pytest.approx(plain.mean_loss().item())
    with pytest.raises(ConfigError, match="task.label_smoothing must be in"):
        TextClassificationTask(make_cfg(label_smoothing=1.0))


def test_binary_f1_is_positive_class():
    task = TextClassificationTask(mrpc_config())
    logits = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    metrics = task.compute_metrics(logits, torch.tensor([1, 0, 0, 1]))
    assert metrics["accuracy"] == 0.5 and metrics["f1"] == pytest.approx(0.5)


@pytest.mark.parametrize("sharded, pooling", [(False, "cls"), (True, "cls"), (False, "mean")])
def test_save_artifacts_round_trip(make_cfg, tmp_path, sharded, pooling):
    from safetensors.torch import save_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    task = TextClassificationTask(make_cfg(max_length=32, pooling=Pooling(pooling)))
    data = task.build_data(FakeRuntime())
    model = task.build_model().eval()
    export = tmp_path / "export"
    task.save_artifacts(model, export)
    if sharded:  # what the engine writes for a large model: shards + model.safetensors.index.json
        model.save_pretrained(export, max_shard_size="40KB")
        assert (export / "model.safetensors.index.json").is_file()
    else:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(export / "model.safetensors"), metadata={"format": "pt"})

    remote_code = pooling == "mean"  # the mean-pooling head ships as code next to the weights
    loaded = AutoModelForSequenceClassification.from_pretrained(export, trust_remote_code=remote_code).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert loaded.config.id2label == {0: "not_equivalent", 1: "equivalent"}
    pair = ('He said "the witness" was there.', "Police denied it.")
    assert tokenizer(*pair)["input_ids"] == task.tokenizer(*pair)["input_ids"]
    batch = data.collate_fn([data.eval[i] for i in range(4)])
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits)
    if remote_code:
        # Without trust_remote_code the load fails instead of building a [CLS] head on these weights.
        with pytest.raises(ValueError, match="trust_remote_code"):
            AutoModelForSequenceClassification.from_pretrained(export)
        # Fine-tuning an export again (task.model=<export>) keeps its head, whatever task.pooling says.
        again = TextClassificationTask(make_cfg(model=str(export), pooling=Pooling.cls)).build_model().eval()
        with torch.no_grad():
            torch.testing.assert_close(again(**batch).logits, model(**batch).logits)


def test_mean_pooling_ignores_padding_and_trains_every_parameter(make_cfg):
    task = TextClassificationTask(make_cfg(max_length=32, pooling=Pooling.mean))
    data = task.build_data(FakeRuntime())
    model = task.build_model().eval()
    rows = [data.eval[i] for i in range(6)]
    batch = data.collate_fn(rows)
    with torch.no_grad():
        together = model(**batch).logits
        alone = torch.cat([model(**data.collate_fn([r])).logits for r in rows])
    assert batch["attention_mask"].min() == 0  # some rows were padded
    torch.testing.assert_close(together, alone)
    model.train()
    task.step(model, batch).mean_loss().backward()
    # No unused parameter (BERT's pooler is dropped): DDP would otherwise wait for its gradient.
    assert all(p.grad is not None for p in model.parameters())


def test_symmetric_eval_averages_both_orders_of_each_pair(make_cfg):
    task = TextClassificationTask(make_cfg(max_length=32, symmetric_eval=True))
    data = task.build_data(FakeRuntime())
    assert "swapped_input_ids" in data.eval.column_names
    assert "swapped_input_ids" not in data.train.column_names  # training sees the pairs as given
    model = task.build_model().eval()
    rows = [data.eval[i] for i in range(5)]
    batch = data.collate_fn(rows)
    raw = load_glue_folder(task.cfg.data_dir, MRPC)["validation"].data
    first, second = raw["sentence1"][:5], raw["sentence2"][:5]
    ab = task.tokenizer(first, second, padding=True, truncation=True, max_length=32, return_tensors="pt")
    ba = task.tokenizer(second, first, padding=True, truncation=True, max_length=32, return_tensors="pt")
    assert torch.equal(batch["input_ids"], ab["input_ids"]) and torch.equal(batch["swapped_input_ids"], ba["input_ids"])
    with torch.no_grad():
        expected = (model(**ab).logits.log_softmax(-1) + model(**ba).logits.log_softmax(-1)) / 2
        out = task.step(model, batch)
        # The same pairs given the other way round score the same: the prediction has no order.
        exchanged = {**{k: batch["swapped_" + k] for k in ("input_ids", "attention_mask", "token_type_ids")},
                     **{"swapped_" + k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")},
                     "labels": batch["labels"]}
        torch.testing.assert_close(task.predict(model, exchanged), out.logits)
    torch.testing.assert_close(out.logits, expected)
    torch.testing.assert_close(out.mean_loss(), torch.nn.functional.cross_entropy(expected, batch["labels"]))
    assert not torch.allclose(model(**ab).logits.log_softmax(-1), expected)  # the orders did disagree
    # The test split gets both orders too, so its predictions are the evaluated ones.
    assert "swapped_input_ids" in task.test_dataset().column_names


# -- test split ----------------------------------------------------------------------------------------


def one_hot(classes: list[int]) -> torch.Tensor:
    """Logits that predict ``classes``."""
    return torch.nn.functional.one_hot(torch.tensor(classes), 2).float()


def test_test_split_and_predictions(make_cfg, tmp_path):
    task = TextClassificationTask(make_cfg(max_length=32, predict_test=True))
    task.build_data(FakeRuntime())
    test = task.test_dataset()
    # Its labels (the synthetic test file has some) are not read: predictions need none.
    assert len(test) == 8 and test["labels"] == [IGNORE_INDEX] * 8
    out = tmp_path / "test_predictions.tsv"
    task.write_predictions(one_hot([1, 0, 1, 1, 0, 0, 1, 0]), out)
    lines = out.read_text().splitlines()
    assert lines[0] == "index\tprediction" and lines[1:3] == ["0\t1", "1\t0"] and len(lines) == 9
    with pytest.raises(ValueError):
        task.write_predictions(one_hot([1]), out)


def test_unlabeled_test_split_predicts(make_cfg, tiny_data, tmp_path):
    folder = tmp_path / "glue"
    folder.mkdir()
    for name in ("train.tsv", "validation.tsv"):
        (folder / name).write_bytes((tiny_data / name).read_bytes())
    (folder / "test.tsv").write_text(
        'index\t#1 ID\t#2 ID\t#1 String\t#2 String\n7\t1\t2\tHe said "yes.\tShe said no.\n'
    )
    task = TextClassificationTask(make_cfg(max_length=32, predict_test=True, data_dir=str(folder)))
    data = task.build_data(FakeRuntime())
    test = task.test_dataset()
    assert test["labels"] == [IGNORE_INDEX]
    logits = task.predict(task.build_model(), data.collate_fn([test[0]]))
    assert logits.shape == (1, 2)
    task.write_predictions(logits, tmp_path / "p.tsv")
    assert (tmp_path / "p.tsv").read_text().splitlines()[1].startswith("7\t")


def test_a_run_writes_test_predictions_of_its_evaluated_weights(tiny_data, tiny_model, tmp_path):
    """task.predict_test=true: the engine writes one prediction per test row, in file order, made by
    the weights it evaluates and exports (here the trainer.ema_decay average)."""
    from app.engine.build import build_accelerator, build_components, build_early_stopping
    from app.engine.loop import LoopState, fit
    from app.engine.predict import write_test_predictions
    from tests.conftest import compose_config

    cfg = compose_config("task=glue_mrpc", f"task.data_dir={tiny_data}", f"task.model={tiny_model}",
                         f"task.cache_dir={tmp_path / 'cache'}", "task.max_length=32", "task.predict_test=true",
                         "trainer.max_steps=4", "trainer.batch_size=8", "trainer.eval_batch_size=3",
                         "trainer.ema_decay=0.5", "optim.lr=0.01", "logging.trackers=[]",
                         "logging.progress_bar=false")
    acc = build_accelerator(cfg, tmp_path)
    acc.init_trackers("test")
    c = build_components(cfg, acc)
    fit(c, cfg, LoopState(), build_early_stopping(cfg))
    path = tmp_path / "test_predictions.tsv"
    write_test_predictions(c, path)
    acc.end_training()

    rows = [line.split("\t") for line in path.read_text().splitlines()]
    test = c.task.test_dataset()
    assert rows[0] == ["index", "prediction"] and len(rows) == 1 + len(test) == 9
    assert [int(i) for i, _ in rows[1:]] == list(range(8))  # the test file's index column, in order
    collate = c.eval_loader.base_dataloader.collate_fn
    model = c.model.eval()
    with torch.no_grad(), c.weight_average.applied():  # the run's batches of 3, padded alike
        batches = [collate([test[i] for i in range(k, min(k + 3, len(test)))]) for k in range(0, len(test), 3)]
        expected = torch.cat([c.task.predict(model, b).argmax(-1) for b in batches])
    assert [int(p) for _, p in rows[1:]] == expected.tolist()


def test_predict_test_without_test_split(make_cfg, tmp_path):
    make_tiny_glue_tsv(tmp_path / "d", n_train=4, n_val=4)
    with pytest.raises(ConfigError, match="test split"):
        TextClassificationTask(make_cfg(data_dir=str(tmp_path / "d"), predict_test=True)).build_data(FakeRuntime())


# -- the real data -------------------------------------------------------------------------------------


@pytest.mark.skipif(not REAL_DATA.is_dir(), reason=f"real GLUE MRPC files not found at {REAL_DATA}")
def test_real_mrpc_files():
    splits = load_glue_folder(str(REAL_DATA), MRPC)
    assert {name: len(s.data) for name, s in splits.items()} == {
        "train": 3668,
        "validation": 408,
        "test": 1725,
    }
    assert sum(splits["validation"].data["label"]) == 279
    assert sum(splits["train"].data["label"]) == 2474
    first = splits["train"].data[0]
    assert first["sentence1"].startswith('Amrozi accused his brother, whom he called "the witness", of')
    assert first["label"] == 1 and first["idx"] == 0


def test_a_mean_pooled_sentence_transformers_model_gets_a_hint(make_cfg, tiny_model, tmp_path, caplog):
    import shutil

    folder = shutil.copytree(tiny_model, tmp_path / "st_model")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    with caplog.at_level("INFO", logger="app.tasks.text.models"):
        TextClassificationTask(make_cfg(model=str(tiny_model))).build_model()
        assert "task.pooling=mean" not in caplog.text
        TextClassificationTask(make_cfg(model=str(folder))).build_model()
    assert "task.pooling=mean" in caplog.text
