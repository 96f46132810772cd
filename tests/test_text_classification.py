"""``task=text_classification``: the user's own data by configuration alone.

The formats users bring (CSV, TSV, JSON, JSON Lines, parquet, save_to_disk, datasets.load_dataset of
a folder) read alike; the problem and the label set come from the label column (string or integer
classes, floats, lists); a held-out evaluation set when there is none; metrics by name from
scikit-learn and SciPy; the label set in every checkpoint; end to end with the export loading with
from_pretrained and carrying the label names; a regression resumed exactly and evaluated with
mode=eval. Bad data: tests/test_bad_text_data.py.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config import ConfigError
from app.tasks.text.config import DataFiles, TextClassificationConfig
from app.tasks.text.metrics import Problem, compute
from app.tasks.text.task import LabelState, TextClassificationTask
from tests.conftest import run_app
from tests.helpers.text_data import (
    pair_rows,
    score_rows,
    tag_rows,
    topic_rows,
    write_csv,
    write_jsonl,
)
from tests.helpers.tiny_bert import FakeRuntime

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch, tmp_path_factory):
    """No test may reach the network or write to ~/.cache."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))


@pytest.fixture
def tiny_model(text_model) -> Path:
    return text_model


def task_for(tmp_path: Path, model: Path, **values) -> TextClassificationTask:
    files = values.pop("files", {})
    cfg = TextClassificationConfig(model=str(model), cache_dir=str(tmp_path / "cache"), data_files=DataFiles(**files),
                                   **values)
    return TextClassificationTask(cfg)


def test_the_formats_users_bring_read_alike(tmp_path, tiny_model):
    """The same rows as CSV, TSV, JSON, JSON Lines, parquet and a save_to_disk folder, and through
    datasets.load_dataset of a folder (the real call of task.dataset), give the same training set."""
    import datasets

    rows = topic_rows(40, seed=1)
    records = [{"text": text, "label": label} for text, label in rows]
    write_csv(tmp_path / "d.csv", ["text", "label"], rows)
    write_csv(tmp_path / "d.tsv", ["text", "label"], rows, delimiter="\t")
    (tmp_path / "d.json").write_text(json.dumps(records))
    write_jsonl(tmp_path / "d.jsonl", records)
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    folder = tmp_path / "folder"  # what load_dataset(folder) reads: split names from the file names
    write_csv(folder / "train.csv", ["text", "label"], rows)
    write_csv(folder / "validation.csv", ["text", "label"], topic_rows(10, seed=2))

    expected = None
    for source in ("d.csv", "d.tsv", "d.json", "d.jsonl", "d.parquet", "saved", "load_dataset"):
        if source == "load_dataset":
            task = task_for(tmp_path, tiny_model, dataset=str(folder))
        else:
            task = task_for(tmp_path, tiny_model, files={"train": str(tmp_path / source)})
        data = task.build_data(FakeRuntime())
        assert task.labels is not None and task.labels.names == ("0", "1", "2", "3", "4"), source
        if source == "load_dataset":
            assert len(data.train) == 40 and len(data.eval) == 10  # its validation split, not a held-out part
            continue
        got = (sorted(map(tuple, data.train["input_ids"])), sorted(data.train["labels"]), len(data.eval))
        expected = expected or got
        assert got == expected, source


def test_string_labels_of_pairs_a_held_out_evaluation_set_and_the_export(tmp_path, tiny_model):
    from transformers import AutoModelForSequenceClassification

    rows = pair_rows(60, seed=1)
    write_csv(tmp_path / "train.csv", ["question", "answer", "label"], rows)
    runtime = FakeRuntime()
    task = task_for(tmp_path, tiny_model, files={"train": str(tmp_path / "train.csv")},
                    text_fields=["question", "answer"], eval_fraction=0.25)
    data = task.build_data(runtime)
    assert task.labels is not None and task.labels.problem is Problem.single_label
    assert task.labels.names == ("no", "yes")  # sorted: the same ids on every process and every resume
    # No validation file: a quarter held out, seeded and stratified (30 yes and 30 no: 15 rows, 8 of one).
    assert len(data.train) == 45 and len(data.eval) == 15
    held = Counter(data.eval["labels"])
    assert sorted(held.values()) == [7, 8]
    again = task_for(tmp_path, tiny_model, files={"train": str(tmp_path / "train.csv")},
                     text_fields=["question", "answer"], eval_fraction=0.25).build_data(FakeRuntime())
    assert again.eval["input_ids"] == data.eval["input_ids"]
    other_seed = task_for(tmp_path, tiny_model, files={"train": str(tmp_path / "train.csv")},
                          text_fields=["question", "answer"], eval_fraction=0.25, split_seed=1)
    assert other_seed.build_data(FakeRuntime()).eval["input_ids"] != data.eval["input_ids"]
    assert all(1 in row for row in data.train["token_type_ids"])  # encoded as pairs

    # The label set is checkpoint state: a resume whose data gives other labels is refused.
    (state,) = [obj for obj in runtime.checkpointed if isinstance(obj, LabelState)]
    assert state.state_dict() == {"problem": "single_label", "labels": ["no", "yes"]}
    state.load_state_dict({"problem": "single_label", "labels": ["no", "yes"]})
    with pytest.raises(ConfigError, match=r"^the checkpoint was trained on the single_label labels maybe, no, yes, "
                                          r"and the training data now gives no, yes; resume with the data it was "
                                          r"trained on\.$"):
        state.load_state_dict({"problem": "single_label", "labels": ["maybe", "no", "yes"]})

    model = task.build_model().eval()
    task.save_artifacts(model, tmp_path / "export")
    model.save_pretrained(tmp_path / "export")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export")
    assert loaded.config.id2label == {0: "no", 1: "yes"} and loaded.config.label2id == {"no": 0, "yes": 1}
    task.write_predictions(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), tmp_path / "p.tsv")
    assert (tmp_path / "p.tsv").read_text().splitlines()[1:] == ["0\tyes", "1\tno"]  # as the data writes them


def test_the_data_summary_counts_the_rows_cut_at_max_length_and_names_the_held_out_set(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    rows = topic_rows(50, seed=4)  # 5 to 13 words: some longer than 10 tokens, some not
    write_csv(tmp_path / "topics.csv", ["text", "label"], rows)
    task = task_for(tmp_path, tiny_model, files={"train": str(tmp_path / "topics.csv")}, text_fields=["text"],
                    max_length=10, eval_fraction=0.2)
    data = task.build_data(FakeRuntime())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    long = [len(tokenizer(text)["input_ids"]) >= 10 for text, _ in rows]
    cut_eval = sum(len(ids) >= 10 for ids in data.eval["input_ids"])
    assert 0 < sum(long) < len(rows) and cut_eval + sum(len(ids) >= 10 for ids in data.train["input_ids"]) == sum(long)
    assert task.data_summary() == [
        f"train: 40 rows of {tmp_path / 'topics.csv'}", f"evaluation: 10 rows of {tmp_path / 'topics.csv'} (held out)",
        "labels 0=0, 1=1, 2=2, 3=3, 4=4",
        f"rows cut at task.max_length=10 tokens: {sum(long) - cut_eval} training, {cut_eval} evaluation"]


def test_the_label_column_says_which_problem(tmp_path, tiny_model):
    """Integers: classes (by number: 10 after 9); floats: a regression; lists: a multi-label problem.
    The metrics the monitor may name follow (before the data is read: those of every problem)."""
    write_jsonl(tmp_path / "classes.jsonl", [{"text": t, "label": label * 5} for t, label in topic_rows(30, 2)])
    write_csv(tmp_path / "scores.csv", ["review", "score"], score_rows(30, 3))
    write_jsonl(tmp_path / "tags.jsonl", [{"text": t, "tags": tags} for t, tags in tag_rows(30, 4)])
    cases = {
        "classes.jsonl": ({}, Problem.single_label, ("0", "5", "10", "15", "20"), ("loss", "accuracy", "f1")),
        "scores.csv": ({"text_fields": ["review"], "label_field": "score"}, Problem.regression, ("score",),
                       ("loss", "pearson", "spearman")),
        "tags.jsonl": ({"label_field": "tags"}, Problem.multi_label, ("access", "billing", "delivery"),
                       ("loss", "f1_micro", "f1_macro")),
    }
    for name, (options, problem, names, metrics) in cases.items():
        task = task_for(tmp_path, tiny_model, files={"train": str(tmp_path / name)}, **options)
        assert set(task.metric_names) == {"loss", "accuracy", "f1", "pearson", "spearman", "f1_micro", "f1_macro"}
        data = task.build_data(FakeRuntime())
        assert task.labels is not None and (task.labels.problem, task.labels.names) == (problem, names), name
        assert task.metric_names == metrics, name
        model = task.build_model().eval()
        batch = data.collate_fn([data.eval[i] for i in range(len(data.eval))])
        with torch.no_grad():
            out = task.step(model, batch)
        assert out.logits.shape == (len(data.eval), 1 if problem is Problem.regression else len(names))
        assert set(task.compute_metrics(out.logits, out.labels)) == set(metrics), name
    assert batch["labels"].dtype == torch.float32 and batch["labels"].shape == (len(data.eval), 3)  # multi-hot


def test_metrics_are_scikit_learns_and_scipys():
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef

    rng = np.random.default_rng(0)
    labels = torch.from_numpy(rng.integers(0, 3, 50))
    logits = torch.from_numpy(rng.normal(size=(50, 3))).float()
    pred = logits.argmax(-1).numpy()
    got = compute(Problem.single_label, ["accuracy", "f1", "matthews_corrcoef"], logits, labels, "macro")
    assert got["f1"] == pytest.approx(f1_score(labels.numpy(), pred, average="macro"))
    assert got["matthews_corrcoef"] == pytest.approx(matthews_corrcoef(labels.numpy(), pred))
    assert got["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item())
    # Binary F1 is class 1's; macro averages every class of the label set, also one no row has.
    binary = compute(Problem.single_label, ["f1"], logits[:, :2], labels.clamp(max=1), "binary")["f1"]
    assert binary == pytest.approx(f1_score(labels.clamp(max=1).numpy(), logits[:, :2].argmax(-1).numpy()))
    absent = compute(Problem.single_label, ["f1"], logits, torch.zeros(50, dtype=torch.long), "macro")["f1"]
    assert absent == pytest.approx(f1_score(np.zeros(50), pred, average="macro", labels=[0, 1, 2], zero_division=0))
    scores = torch.from_numpy(rng.normal(size=50)).float()
    outputs = scores[:, None] + torch.from_numpy(rng.normal(size=(50, 1))).float()
    got = compute(Problem.regression, ["pearson", "spearman"], outputs, scores, "binary")
    assert got["pearson"] == pytest.approx(pearsonr(scores.numpy(), outputs[:, 0].numpy())[0], rel=1e-5)
    assert got["spearman"] == pytest.approx(spearmanr(scores.numpy(), outputs[:, 0].numpy())[0], rel=1e-5)
    hot = torch.from_numpy(rng.integers(0, 2, (50, 4))).float()
    multi = compute(Problem.multi_label, ["f1_micro", "f1_macro"], torch.from_numpy(rng.normal(size=(50, 4))), hot,
                    "binary")
    assert 0.0 < multi["f1_micro"] < 1.0 and 0.0 < multi["f1_macro"] < 1.0


@pytest.mark.timeout(240)
def test_two_text_columns_with_yes_no_labels_train_predict_and_export_their_label_names(tmp_path, tiny_model):
    """A CSV of (question, answer) with yes/no labels, a validation file and an unlabeled test file,
    as a user runs it (on two processes the text task runs in tests/test_glue_sst2.py and
    tests/test_glue_mrpc_app.py: the GLUE presets are this task)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    header = ["question", "answer", "label"]
    write_csv(tmp_path / "train.csv", header, pair_rows(48, seed=1))
    write_csv(tmp_path / "dev.csv", header, pair_rows(21, seed=2))
    write_csv(tmp_path / "test.csv", header[:2], [r[:2] for r in pair_rows(7, seed=3)])
    run_dir = tmp_path / "run"
    run_app("task=text_classification", "task.data_files.train=train.csv", "task.data_files.validation=dev.csv",
            "task.data_files.test=test.csv", "task.text_fields=[question,answer]", f"task.model={tiny_model}",
            f"task.cache_dir={tmp_path / 'cache'}", "task.max_length=32", "task.predict_test=true",
            "task.metrics=[accuracy,f1,matthews_corrcoef]", "early_stopping.monitor=eval/f1", "early_stopping.mode=max",
            "trainer.max_steps=4", "trainer.eval_every_n_steps=2", "trainer.batch_size=8", *QUIET,
            f"hydra.run.dir={run_dir}", cwd=tmp_path, check=True, timeout=220, env={"OMP_NUM_THREADS": "1"})

    log = (run_dir / "app.log").read_text()
    assert log.count("training text_classification on 1 process(es);") == 1
    # What it learnt from, at the start: the splits, the labels' ids, the pairs cut at max_length (issue 42, item 11).
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cut = {name: sum(len(tokenizer(q, a)["input_ids"]) >= 32 for q, a, _ in pair_rows(n, seed=seed))
           for name, n, seed in (("training", 48, 1), ("evaluation", 21, 2))}
    assert (f"data: train: 48 rows of train.csv; evaluation: 21 rows of dev.csv; test: 7 rows of test.csv; labels "
            f"no=0, yes=1; rows cut at task.max_length=32 tokens: {cut['training']} training, {cut['evaluation']} "
            "evaluation\n") in log, log
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if "eval/f1" in e]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["eval/num_samples"] == 21 and {"eval/accuracy", "eval/matthews_corrcoef"} <= set(e) for e in evals)
    rows = (run_dir / "test_predictions.tsv").read_text().splitlines()
    assert rows[0] == "index\tprediction" and [r.split("\t")[0] for r in rows[1:]] == [str(i) for i in range(7)]
    assert {r.split("\t")[1] for r in rows[1:]} <= {"yes", "no"}
    loaded = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    assert loaded.config.id2label == {0: "no", 1: "yes"}
    encoded = AutoTokenizer.from_pretrained(run_dir / "model")(["is it late?"], ["yes it is."], return_tensors="pt")
    assert loaded(**encoded).logits.shape == (1, 2)
    state = json.loads((run_dir / "checkpoints" / "checkpoint_0" / "custom_checkpoint_0.json").read_text())
    assert state == {"problem": "single_label", "labels": ["no", "yes"]}  # saved with the run


@pytest.mark.timeout(240)
def test_a_score_column_is_a_regression_that_resumes_exactly(tmp_path, tiny_model):
    """Floats in the label column: one output, mean squared error, eval/pearson and eval/spearman; a run
    stopped at step 3 and resumed ends as the one that ran through, bit for bit, and mode=eval of its
    export measures what training measured (the engine's run, in this process: more interpreters would
    only import the same libraries again). A constant learning rate: a linear schedule would differ
    with the number of steps."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from app.engine.run import run
    from tests.conftest import compose_many

    write_csv(tmp_path / "scores.csv", ["review", "score"], score_rows(60, seed=3))
    common = ["task=text_classification", f"task.data_files.train={tmp_path / 'scores.csv'}",
              "task.text_fields=[review]", "task.label_field=score", f"task.model={tiny_model}",
              f"task.cache_dir={tmp_path / 'cache'}", "task.max_length=32", "trainer.batch_size=8",
              "trainer.eval_every_n_steps=3", "checkpoint.every_n_steps=3", "trainer.max_epochs=-1",
              "scheduler=constant", "scheduler.warmup_ratio=0", *QUIET]
    through, split, resumed, evaluated = compose_many([
        [*common, "trainer.max_steps=6"], [*common, "trainer.max_steps=3"],
        [*common, "trainer.max_steps=6", f"resume={tmp_path / 'split'}"],
        [*common, "trainer.max_steps=6", "mode=eval", f"resume={tmp_path / 'split' / 'model'}"]])
    for cfg, folder in ((through, "through"), (split, "split"), (resumed, "split"), (evaluated, "evaluated")):
        (tmp_path / folder).mkdir(exist_ok=True)
        run(cfg, tmp_path / folder)

    def evaluations(folder: str) -> list[dict]:
        events = [json.loads(x) for x in (tmp_path / folder / "metrics.jsonl").read_text().splitlines()]
        return [e for e in events if "eval/pearson" in e]

    expected = evaluations("through")
    assert [e["step"] for e in expected] == [3, 6] and all(e["eval/num_samples"] == 6 for e in expected)
    assert {"eval/loss", "eval/pearson", "eval/spearman"} <= set(expected[-1])
    assert evaluations("split") == expected  # same losses and metrics, bit for bit
    weights = [load_file(tmp_path / folder / "model" / "model.safetensors") for folder in ("through", "split")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    exported = json.loads((tmp_path / "split" / "model" / "export.json").read_text())["step"]
    measured = json.loads((tmp_path / "evaluated" / "eval_metrics.json").read_text())["metrics"]
    assert measured == {k: v for k, v in next(e for e in expected if e["step"] == exported).items()
                        if k.startswith("eval/")}  # mode=eval of the export measures what training measured
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "split" / "model")
    assert loaded.config.num_labels == 1 and loaded.config.problem_type == "regression"
    assert loaded.config.id2label == {0: "score"}
