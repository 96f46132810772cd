"""Bad input ends in one sentence, said once, and a non-zero exit, leaving nothing behind (no run
folder): unknown options and keys (the closest key named), keys added with ``+``, impossible values,
an unwritable run folder, a monitor
the task does not report, a batch larger than the data, more processes than cores, GLUE files that
are not what they should be, a tokenizer that cannot encode the data; and a run that diverges exits
non-zero without exporting non-finite weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.cli.job import unknown_keys
from app.config import ConfigError
from app.distributed import Accelerator
from app.distributed.checkpoint import store
from app.distributed.checkpoint.format import read_safetensors
from app.distributed.hardware.multi_cpu import available_cores
from tests.conftest import compose_config, run_app
from tests.helpers.tiny_bert import HEADER, make_tiny_bert, make_tiny_glue_tsv, synthetic_pairs

QUIET = ("logging.progress_bar=false", "logging.trackers=[]")

REFUSED = {
    "plus_key": (["+trainer.batchsize=3"], ("unknown configuration key trainer.batchsize (added with "
                                            "+trainer.batchsize=...); did you mean trainer.batch_size?")),
    # Hydra's own refusals, in the app's words: the options without the schemas stored beside them,
    # the closest key instead of Hydra's hint to add it with + (which the app would then refuse).
    "option": (["precision=fp8"], "error: precision=fp8 is not an option of precision; choose one of bf16, fp16, no."),
    "typo_key": (["trainer.batchsize=3"], "unknown configuration key trainer.batchsize; did you mean trainer.batch_size?"),
    # A run folder where its exported model is meant: the sentence names <run>/model (issue 51).
    "run_folder": (["task=sft", "task.model=trained", "task.data_files.train=chat.jsonl"],
                   "task.model=trained is a run folder, not a model folder: its exported model is task.model=trained/model."),
    # TRL's name for ours, and the keys of the task chosen (not the default one's).
    "trl_name": (["task=sft", "per_device_train_batch_size=8"], (
        "unknown configuration key per_device_train_batch_size: TRL's per_device_train_batch_size is "
        "trainer.batch_size here (docs/coming-from-trl.md); python -m app task=sft --cfg job lists the keys.")),
    "dropout": (["task.dropout=2.0"], "task.dropout must be in [0, 1), got 2.0."),
    "max_steps_0": (["trainer.max_steps=0"], ("trainer.max_steps=0 trains nothing; give a positive number of "
                                             "optimizer steps, or -1")),
    "batch": (["trainer.batch_size=100000"], ("trainer.batch_size=100000 is more than the 1437 training samples "
                                             "each of the 1 process(es) gets")),
    "monitor": (["early_stopping.monitor=eval/nonexistent"],
                ("early_stopping.monitor=eval/nonexistent is not a metric the task digits reports; choose one of "
                "eval/loss, eval/accuracy, eval/f1.")),
    "cores": (["hardware=multi_cpu", "hardware.num_processes=64"],
              f"hardware.num_processes=64 asks for more CPU processes than the {available_cores()} core(s)"),
}


@pytest.mark.timeout(240)
def test_bad_inputs_are_one_sentence_and_leave_nothing_behind(tmp_path):
    """Each case is a real ``python -m app``; they run side by side to save time."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    (tmp_path / "trained" / "model").mkdir(parents=True)
    (tmp_path / "trained" / "model" / "config.json").write_text("{}")
    procs = {}
    for name, (args, _) in REFUSED.items():
        procs[name] = subprocess.Popen([sys.executable, "-m", "app", *args, *QUIET, f"hydra.run.dir={tmp_path / name}"],
                                       cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs["proc_dir"] = subprocess.Popen([sys.executable, "-m", "app", "hydra.run.dir=/proc/x"], cwd=tmp_path,
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs["timestamped"] = subprocess.Popen([sys.executable, "-m", "app", "trainer.batch_size=0", *QUIET], cwd=tmp_path,
                                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=200)
        assert proc.returncode == 2, (name, err[-3000:])
        assert "Traceback" not in err and "_schema" not in err and "To append" not in err, (name, err[-3000:])
        lines = err.strip().splitlines()
        assert lines[-1].startswith("error: ") and lines[-1].endswith("."), (name, lines[-1])
        sentence = lines[-1].removeprefix("error: ")
        assert (out + err).count(sentence) == 1, (name, out, err)  # said once, not also as a log line
        if name == "timestamped":
            assert not (tmp_path / "outputs").exists()  # no outputs/<date>/<time>/ stub
            continue
        if name == "proc_dir":
            assert lines == [("error: hydra.run.dir=/proc/x cannot be used as a run folder (No such file or directory); "
                             "choose a writable folder.")]
            continue
        assert REFUSED[name][1] in lines[-1], (name, lines[-1])
        assert not (tmp_path / name).exists(), (name, list((tmp_path / name).rglob("*")))


def test_unknown_keys_are_found_at_any_depth():
    cfg = compose_config("+foo=bar", "+trainer.batchsize=3", "+task.dropuot=0.5")
    from omegaconf import OmegaConf

    from app.config import as_plain

    composed = OmegaConf.to_container(OmegaConf.structured(as_plain(cfg)))
    composed["foo"], composed["trainer"]["batchsize"], composed["task"]["dropuot"] = "bar", 3, 0.5
    assert unknown_keys(composed, cfg) == ["task.dropuot", "trainer.batchsize", "foo"]
    assert unknown_keys(OmegaConf.to_container(OmegaConf.structured(as_plain(compose_config()))), compose_config()) == []


@pytest.mark.timeout(120)
def test_a_diverged_run_exits_nonzero_and_exports_nothing_non_finite(tmp_path):
    run = tmp_path / "run"
    proc = run_app("optim.lr=1e9", "trainer.max_steps=30", "checkpoint.every_n_steps=1", "trainer.log_every_n_steps=3",
                   *QUIET, f"hydra.run.dir={run}", cwd=tmp_path, timeout=110)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training diverged: the training loss was not finite at step 3, so no model was "
                           "exported; "), last
    assert not (run / "model").exists()
    kept = store.complete_checkpoints(run / "checkpoints")
    assert kept, "the steps before the divergence were saved"
    assert f"the last finite checkpoint is {kept[-1][0]}" in last
    for folder, _ in kept:  # every checkpoint left is finite: none was saved after the weights broke
        weights, _ = read_safetensors(folder / "model.safetensors")
        assert all(torch.isfinite(t).all() for t in weights.values()), folder


def peak_growth_mib(fn) -> float | None:
    """How far this process's peak resident memory rises above its current level while ``fn`` runs
    (Linux: ``/proc/self/clear_refs`` resets the peak); None where that cannot be read."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS")
        fn()
        return (status("VmHWM") - before) / 1024
    except OSError:
        return None


def test_the_finiteness_check_finds_every_nan_and_infinity_without_a_copy_of_the_weights():
    from app.engine.divergence import has_non_finite

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for bad in (float("nan"), float("inf"), -float("inf")):
            weights = torch.randn(64, 33).to(dtype)
            weights[40, 7] = bad
            assert has_non_finite(weights), (dtype, bad)
        extremes = torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min, 0.0], dtype=dtype)
        assert not has_non_finite(extremes), dtype
    assert not has_non_finite(torch.empty(0)) and not has_non_finite(torch.arange(5))  # an empty shard; integers
    # The check runs before every checkpoint and at the end of a run: torch.isfinite would build a
    # float copy and bool tensors of each parameter (here 200 MB + 150 MB) at the peak of the run.
    weights = torch.ones(50_000_000)
    growth = peak_growth_mib(lambda: has_non_finite(weights))
    if growth is None:
        pytest.skip("no /proc/self/clear_refs here to measure the peak")
    assert growth < 20, f"the check raised the peak resident memory by {growth:.0f} MiB"


# -- GLUE MRPC files and model folders -------------------------------------------------------------------


def glue_refusal(path: Path) -> str:
    from app.tasks.text.glue import GLUE_SPECS, GlueName
    from app.tasks.text.tsv import read_glue_tsv

    MRPC = GLUE_SPECS[GlueName.mrpc]

    with pytest.raises(ConfigError) as err:
        read_glue_tsv(path, MRPC)
    message = str(err.value)
    assert message.endswith(".") and "\n" not in message and str(path) in message
    return message


def test_glue_tsv_problems_name_the_file_the_line_and_what_was_expected(tmp_path):
    good = "1\t1\t2\tA said it.\tA said so.\n"
    cases = {
        "label.tsv": (f"{HEADER}\n{good}yes\t3\t4\tB.\tC.\n", "line 3 has Quality 'yes' where 0 or 1 was expected"),
        "header_only.tsv": (f"{HEADER}\n", "has a header line but no sentence pairs"),
        "fields.tsv": (f"{HEADER}\n{good}0\t3\tB.\n", "line 3 has 3 fields where the header has 5"),
    }
    for name, (text, fragment) in cases.items():
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        assert fragment in glue_refusal(path), name
    garbage = tmp_path / "garbage.tsv"
    garbage.write_bytes(f"{HEADER}\n{good}".encode() + bytes(range(128, 256)) + b"\n")
    assert "line 3 is not UTF-8 text (byte 0x80), where a GLUE MRPC TSV" in glue_refusal(garbage)
    nul = tmp_path / "nul.tsv"
    nul.write_bytes(f"{HEADER}\n{good}".encode() + b"1\t2\x00\t3\tx\ty\n")
    assert "line 3 holds a NUL byte (binary data?)" in glue_refusal(nul)


@pytest.fixture
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_tokenizer_that_cannot_encode_the_data_and_a_damaged_config_are_named(tmp_path, offline):
    from app.tasks.text.models import load_model
    from app.tasks.text.task import TextClassificationTask
    from tests.helpers.tiny_bert import mrpc_config

    data = make_tiny_glue_tsv(tmp_path / "data", n_train=48, n_val=16)
    model = make_tiny_bert(tmp_path / "bert", [s for _, s1, s2 in synthetic_pairs(100, seed=9) for s in (s1, s2)])
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (model / tokenizer_file).unlink(missing_ok=True)
    cfg = mrpc_config(model=str(model), data_dir=str(data), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as err:
        TextClassificationTask(cfg).build_data(Accelerator(cpu=True))
    assert str(err.value).startswith(f"the tokenizer in {model} encodes 100% of the tokens of the first 48 training "
                                     "pairs as [UNK]; it has only 5 tokens: are its vocabulary files")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())

    config = model / "config.json"
    config.write_text(config.read_text()[:40])
    task = TextClassificationTask(cfg)
    for load in (lambda: TextClassificationTask(cfg).tokenizer, lambda: load_model(str(model), task.label_set())):
        with pytest.raises(ConfigError, match=rf"^{config} is not valid JSON \(.*\); the model folder's configuration "
                                              r"is damaged\.$"):
            load()
