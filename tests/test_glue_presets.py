"""The nine GLUE tasks as presets of text_classification: each composes to its spec (run_glue.py's
columns and official metrics), each reads GLUE's own TSV layout (files written here in that layout:
only MRPC's real files are on these machines), and a sweep over tasks gives one GLUE table with
MNLI's matched and mismatched accuracy and STS-B's correlations."""

from __future__ import annotations

import json
import math

import pytest

from app.tasks.text.config import TextClassificationConfig
from app.tasks.text.glue import GLUE_SPECS, GlueName
from app.tasks.text.metrics import Problem
from app.tasks.text.sources import load_glue_folder
from tests.conftest import compose_many, run_app
from tests.helpers.text_data import GLUE_FOLDERS, write_glue_task

RUN_GLUE = {  # Transformers' run_glue.py: task_to_keys, and the metric its evaluate("glue", task) reports
    "cola": (("sentence",), ("matthews_corrcoef",)),
    "sst2": (("sentence",), ("accuracy",)),
    "mrpc": (("sentence1", "sentence2"), ("accuracy", "f1")),
    "stsb": (("sentence1", "sentence2"), ("pearson", "spearman")),
    "qqp": (("question1", "question2"), ("accuracy", "f1")),
    "mnli": (("premise", "hypothesis"), ("accuracy",)),
    "qnli": (("question", "sentence"), ("accuracy",)),
    "rte": (("sentence1", "sentence2"), ("accuracy",)),
    "wnli": (("sentence1", "sentence2"), ("accuracy",)),
}


def test_every_preset_composes_to_run_glues_columns_and_metrics():
    configs = compose_many([[f"task=glue_{name}"] for name in RUN_GLUE])
    assert {spec.config for spec in GLUE_SPECS.values()} == set(RUN_GLUE)
    for (name, (columns, metrics)), cfg in zip(RUN_GLUE.items(), configs):
        task = cfg.task
        assert isinstance(task, TextClassificationConfig) and task.name == f"glue_{name}" and task.glue.value == name
        spec = GLUE_SPECS[GlueName(name)]
        assert tuple(task.text_fields) == spec.text_columns == columns, name
        assert tuple(task.metrics) == spec.metrics == metrics, name
        assert (task.dataset, task.dataset_config) == ("nyu-mll/glue", name)
        assert task.problem is (Problem.regression if name == "stsb" else Problem.single_label), name
        assert cfg.early_stopping.monitor in {f"eval/{m}" for m in metrics} and cfg.early_stopping.mode.value == "max"


def test_every_glue_tsv_layout_reads_as_the_hubs_columns(tmp_path):
    """glue_data/<Task>/ as GLUE's download leaves it: CoLA without a header, STS-B's score in the last
    column, MNLI's dev_matched/dev_mismatched, QQP's test ids, label names in MNLI/QNLI/RTE."""
    root = tmp_path / "glue_data"
    for name, spec in ((s.config, s) for s in GLUE_SPECS.values()):
        gold = write_glue_task(root / GLUE_FOLDERS[name], name, n=12, seed=len(name))
        splits = load_glue_folder(str(root), spec)
        expected = {"train", *spec.eval_splits, spec.test_split}
        assert set(splits) == expected, name
        dev = {"validation_matched": "dev_matched.tsv", "validation_mismatched": "dev_mismatched.tsv"}
        for split, data in ((s, splits[s].data) for s in expected):
            assert data.column_names == [*spec.text_columns, "label", "idx"], (name, split)
            if split == spec.test_split:
                assert data["idx"] == list(range(6)), name  # the test file's own id column
                unlabeled = [math.isnan(v) for v in data["label"]] if spec.label_names is None else \
                    [v == -1 for v in data["label"]]
                assert all(unlabeled), name
                continue
            file = "train.tsv" if split == "train" else dev.get(split, "dev.tsv")
            assert data["label"] == pytest.approx(gold[file]), (name, split)
            assert all(text.count('"') == 1 for text in data[spec.text_columns[0]]), name  # unquoted, kept as is
            assert len(data) == 12
        if spec.label_names is not None:
            assert splits["train"].data.features["label"].names == list(spec.label_names), name


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_sweep_over_glue_tasks_gives_one_glue_table(tmp_path, text_model):
    """python -m app -m task=glue_mnli,glue_stsb on glue_data/: one job per task, MNLI evaluated on
    matched and mismatched, STS-B a regression, and the sweep report's GLUE summary."""
    root = tmp_path / "glue_data"
    for name in ("mnli", "stsb"):
        write_glue_task(root / GLUE_FOLDERS[name], name, n=24, seed=1)
    sweep = tmp_path / "sweep"
    run_app("-m", "task=glue_mnli,glue_stsb", f"task.data_dir={root}", f"task.model={text_model}",
            f"task.cache_dir={tmp_path / 'cache'}", "task.max_length=32", "trainer.max_steps=4",
            "trainer.eval_every_n_steps=2", "trainer.batch_size=8", "checkpoint.every_epoch=false",
            "logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false",
            f"hydra.sweep.dir={sweep}", cwd=tmp_path, check=True, timeout=380, env={"OMP_NUM_THREADS": "1"})

    def evaluations(job: int) -> list[dict]:
        events = [json.loads(x) for x in (sweep / str(job) / "metrics.jsonl").read_text().splitlines()]
        return [e for e in events if "eval/loss" in e]

    mnli, stsb = evaluations(0), evaluations(1)
    assert all(e["eval/num_samples"] == 24 and e["eval/num_samples_mm"] == 24 for e in mnli)
    assert {"eval/accuracy", "eval/accuracy_mm", "eval/loss_mm"} <= set(mnli[-1])
    assert {"eval/pearson", "eval/spearman"} <= set(stsb[-1]) and "eval/accuracy" not in stsb[-1]
    summary = (sweep / "sweep.md").read_text()
    assert summary.startswith(f"# GLUE summary: sweep {sweep}")
    lines = summary.splitlines()
    table = lines[lines.index("| task | metrics | score | monitor | status | steps | folder |") + 2:][:2]
    assert [row.split(" | ")[0] for row in table] == ["| glue_mnli", "| glue_stsb"]
    assert "accuracy_mm" in table[0] and "spearman" in table[1]
    assert "**GLUE score** over the 2 task(s) run:" in summary


def test_mnli_without_its_mismatched_set_is_refused_and_its_own_files_have_one(tmp_path):
    from app.config import ConfigError
    from app.tasks.text.task import TextClassificationTask
    from tests.conftest import compose_config
    from tests.helpers.tiny_bert import FakeRuntime

    write_glue_task(tmp_path / "MNLI", "mnli", n=12)
    (tmp_path / "MNLI" / "dev_mismatched.tsv").unlink()
    cfg = compose_config("task=glue_mnli", f"task.data_dir={tmp_path}").task
    with pytest.raises(ConfigError, match=r"^the MNLI data has no validation_mismatched split, whose metrics "
                                          r"\(eval/\*_mm\) the task reports\.$"):
        TextClassificationTask(cfg).build_data(FakeRuntime())
    assert TextClassificationTask(cfg).metric_names == ("loss", "accuracy", "loss_mm", "accuracy_mm")
    own = compose_config("task=glue_mnli", "task.data_files.train=train.csv", "task.data_files.validation=dev.csv").task
    assert TextClassificationTask(own).metric_names == ("loss", "accuracy")  # one validation file: one set
