"""Bad data for ``task=text_classification`` ends in one sentence naming the file (and the column,
row or value), exit status 2, and nothing written but Hydra's record and the log: a missing file, a
column that does not exist (the columns that do are listed), an empty split, a label column with one
class, a text field that is not text, a float label with ``problem=single_label``, an evaluation
label the training data does not have, a monitor or metric the problem does not report, no data.

Each case is refused by the task's build_data (checked here in this process, as the engine calls it)
or by the config's rules; a real ``python -m app`` of each kind (the data's, the monitor checked
after the data, a config rule) shows what a user sees: a worker that imports torch and datasets
costs ~7 s of CPU, too much to start one per case."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.config import ConfigError
from app.tasks.text.config import TextClassificationConfig
from tests.helpers.text_data import pair_rows, score_rows, write_csv

QUIET = ("logging.progress_bar=false", "logging.trackers=[]", "logging.print_config=false")
HYDRA_RECORD = {".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "app.log"}
PAIRS = ("task=text_classification", "task.text_fields=[question,answer]", "task.data_files.train=train.csv")

REFUSED = {
    "missing_file": ((*PAIRS, "task.data_files.validation=nope.csv"), "task.data_files.validation=nope.csv does not exist."),
    "missing_column": ((*PAIRS, "task.text_fields=[question,body]"),
                       "train.csv has no column 'body' (task.text_fields); its columns are question, answer, label, n."),
    "empty_split": ((*PAIRS, "task.data_files.validation=empty.csv"), "empty.csv holds no rows."),
    "one_class": ((*PAIRS, "task.data_files.train=one_class.csv"),
                  ("column 'label' of one_class.csv (task.label_field) holds one class only ('yes'); a classifier "
                  "needs two or more.")),
    "not_text": ((*PAIRS, "task.text_fields=[question,n]"),
                 "column 'n' of train.csv (task.text_fields) holds int64 values, not text."),
    "float_single_label": (("task=text_classification", "task.data_files.train=scores.csv", "task.text_fields=[review]",
                            "task.label_field=score", "task.problem=single_label"),
                           ("column 'score' of scores.csv (task.label_field) holds floats such as {fraction}, not classes; set "
                           "task.problem=regression (or leave it unset), or give integer or string labels.")),
    "unseen_label": ((*PAIRS, "task.data_files.validation=dev.csv"),
                     ("dev.csv row 3 has the label 'maybe', which the training data (train.csv) does not have (its "
                     "labels: no, yes).")),
    "monitor": (("task=text_classification", "task.data_files.train=scores.csv", "task.text_fields=[review]",
                 "task.label_field=score", "early_stopping.monitor=eval/accuracy"),
                ("early_stopping.monitor=eval/accuracy is not a metric the task text_classification reports; choose one "
                "of eval/loss, eval/pearson, eval/spearman.")),
    "metric": ((*PAIRS, "task.metrics=[acc]"), ("task.metrics has 'acc', which is not a metric of any problem; choose "
                                               "from accuracy, ")),
    "no_data": (("task=text_classification",), "task=text_classification needs data: task.data_files.train=<file>"),
}


def write_data(folder):
    header = ["question", "answer", "label", "n"]
    rows = [(*row, i) for i, row in enumerate(pair_rows(30, seed=1))]
    write_csv(folder / "train.csv", header, rows)
    write_csv(folder / "dev.csv", header, [rows[0], rows[1], ("a question?", "an answer.", "maybe", 7), rows[3]])
    write_csv(folder / "empty.csv", header, [])
    write_csv(folder / "one_class.csv", header, [row for row in rows if row[2] == "yes"])
    scores = score_rows(30, seed=2)
    write_csv(folder / "scores.csv", ["review", "score"], scores)
    return next(score for _, score in scores if not float(score).is_integer())


def overrides_as_config(args: tuple[str, ...], folder, model) -> TextClassificationConfig:
    """What ``python -m app <args>`` composes for the task, paths made absolute."""
    from tests.conftest import compose_config

    absolute = [a.replace("=", f"={folder}/", 1) if a.startswith("task.data_files.") else a for a in args]
    cfg = compose_config(*absolute, f"task.model={model}", f"task.cache_dir={folder / 'cache'}").task
    assert isinstance(cfg, TextClassificationConfig)
    return cfg


@pytest.mark.timeout(240)
def test_every_bad_text_input_is_one_sentence(tmp_path, text_model, monkeypatch):
    from app.tasks.text.task import TextClassificationTask
    from tests.helpers.tiny_bert import FakeRuntime

    fraction = write_data(tmp_path)
    monkeypatch.chdir(tmp_path)  # the messages name the files as the command line does
    for name, (args, message) in REFUSED.items():
        if name == "monitor":
            continue  # the engine's (after build_data): the subprocess test below
        expected = message.format(fraction=fraction).replace("=nope.csv", f"={tmp_path}/nope.csv")
        with pytest.raises(ConfigError) as refused:
            cfg = overrides_as_config(args, tmp_path, text_model)
            TextClassificationTask(cfg).build_data(FakeRuntime())
        text = str(refused.value).replace(f"{tmp_path}/", "") if name != "missing_file" else str(refused.value)
        assert expected in text, (name, text)
        assert text.endswith(".") and "\n" not in text, name


SUBPROCESS_CASES = ("unseen_label", "monitor", "no_data")
"""One of each kind: the data's (file and row named), the engine's check of the monitor after the data,
a config rule (before torch is imported)."""


@pytest.mark.timeout(240)
def test_bad_text_data_exits_with_one_sentence_and_writes_nothing(tmp_path, text_model):
    fraction = write_data(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    procs = {}
    for name in SUBPROCESS_CASES:  # side by side, to save time
        args = REFUSED[name][0]
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "app", *args, f"task.model={text_model}", f"task.cache_dir={tmp_path / 'cache'}",
             *QUIET, f"hydra.run.dir={tmp_path / name}"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=220)
        assert proc.returncode == 2, (name, err[-3000:])
        assert "Traceback" not in err, (name, err[-3000:])
        lines = err.strip().splitlines()
        assert lines[-1].startswith("error: ") and lines[-1].endswith("."), (name, lines[-1])
        assert REFUSED[name][1].format(fraction=fraction) in lines[-1], (name, lines[-1])
        run_dir = tmp_path / name
        written = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")} if run_dir.exists() else set()
        assert written <= HYDRA_RECORD, (name, written)
