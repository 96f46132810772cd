"""GLUE SST-2, a preset of text_classification (its spec in app/tasks/text/glue.py): single sentences
through the GLUE loaders, TSV parser, tokenization cache and TextClassificationTask, end to end on 1 and
2 processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.config import ConfigError
from app.tasks.text.config import TextClassificationConfig
from app.tasks.text.glue import GLUE_SPECS, GlueName
from app.tasks.text.sources import load_glue_folder
from app.tasks.text.tsv import read_glue_tsv
from tests.conftest import compose_config, run_app
from tests.helpers.tiny_bert import make_tiny_bert, synthetic_pairs

SST2 = GLUE_SPECS[GlueName.sst2]


def sst2_rows(n: int, seed: int) -> list[tuple[int, str]]:
    """(label, sentence): the synthetic MRPC first sentences (unbalanced ``"`` included)."""
    return [(label, s1) for label, s1, _ in synthetic_pairs(n, seed=seed)]


def make_sst2_tsv(folder: Path, n_train: int, n_val: int, n_test: int) -> Path:
    """GLUE's SST-2 layout: train.tsv and dev.tsv ``sentence<TAB>label``, test.tsv ``index<TAB>sentence``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.tsv", sst2_rows(n_train, 1)), ("dev.tsv", sst2_rows(n_val, 2))):
        (folder / name).write_text("sentence\tlabel\n" + "".join(f"{s}\t{label}\n" for label, s in rows))
    test = "".join(f"{i}\t{s}\n" for i, (_, s) in enumerate(sst2_rows(n_test, 3)))
    (folder / "test.tsv").write_text("index\tsentence\n" + test)
    return folder


def test_glue_sst2_composes_with_its_schema_and_recipe():
    cfg = compose_config("task=glue_sst2")
    assert isinstance(cfg.task, TextClassificationConfig) and cfg.task.name == "glue_sst2"
    assert cfg.task.glue is GlueName.sst2 and cfg.task.text_fields == ["sentence"]
    assert cfg.early_stopping.monitor == "eval/accuracy" and cfg.trainer.batch_size == 32


def test_sst2_tsv_files_load_as_single_sentences_with_the_hubs_columns(tmp_path):
    make_sst2_tsv(tmp_path / "SST-2", n_train=6, n_val=3, n_test=2)  # GLUE's own folder name, found by the spec
    splits = load_glue_folder(str(tmp_path), SST2)
    train, test = splits["train"].data, splits["test"].data
    assert {name: len(s.data) for name, s in splits.items()} == {"train": 6, "validation": 3, "test": 2}
    assert train.column_names == ["sentence", "label", "idx"]
    assert train["sentence"] == [s for _, s in sst2_rows(6, 1)] and train["label"] == [lb for lb, _ in sst2_rows(6, 1)]
    assert train.features["label"].names == ["negative", "positive"]
    assert test["idx"] == [0, 1] and test["label"] == [-1, -1]

    bad = tmp_path / "bad.tsv"
    bad.write_text("sentence\tlabel\na fine film .\t1\na dull one .\tyes\n")
    with pytest.raises(ConfigError, match=r"bad.tsv line 3 has label 'yes' where 0 or 1 was expected\.$"):
        read_glue_tsv(bad, SST2)
    bad.write_text("text\tlabel\na fine film .\t1\n")
    with pytest.raises(ConfigError, match=r"is not a GLUE SST-2 TSV: its header has no 'sentence'\.$"):
        read_glue_tsv(bad, SST2)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("processes", [1, 2])
def test_glue_sst2_trains_evaluates_predicts_and_exports(tmp_path, processes):
    data = make_sst2_tsv(tmp_path / "data", n_train=40, n_val=21, n_test=7)  # 21: uneven over 2 processes
    model = make_tiny_bert(tmp_path / "tiny_bert", [s for _, s in sst2_rows(200, seed=9)])
    hardware = ["hardware=multi_cpu", "hardware.num_processes=2"] if processes == 2 else []
    run_dir = tmp_path / "run"
    run_app(f"hydra.run.dir={run_dir}", "task=glue_sst2", f"task.data_dir={data}", f"task.model={model}",
            f"task.cache_dir={tmp_path / 'cache'}", "task.max_length=32", "task.predict_test=true", *hardware,
            "trainer.max_steps=4", "trainer.eval_every_n_steps=2", "trainer.batch_size=8",
            "trainer.eval_batch_size=8", "logging.trackers=[]", "logging.progress_bar=false",
            cwd=tmp_path, check=True, timeout=180)

    log = (run_dir / "app.log").read_text()
    assert log.count(f"training glue_sst2 on {processes} process(es);") == 1  # logged once, by the main process
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if "eval/accuracy" in e]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["eval/num_samples"] == 21 for e in evals)  # every dev sentence once, none twice

    rows = (run_dir / "test_predictions.tsv").read_text().splitlines()
    assert rows[0] == "index\tprediction" and [r.split("\t")[0] for r in rows[1:]] == [str(i) for i in range(7)]
    assert {r.split("\t")[1] for r in rows[1:]} <= {"0", "1"}

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    loaded = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    assert loaded.config.id2label == {0: "negative", 1: "positive"}
    encoded = AutoTokenizer.from_pretrained(run_dir / "model")(["a fine film ."], return_tensors="pt")
    assert loaded(**encoded).logits.shape == (1, 2)
    cached = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").glob("*.arrow"))
    assert cached == ["test", "train", "validation"]  # tokenized once, by the main process, and shared
