"""``adapter=lora``: peft's LoRA on a GLUE MRPC run (tiny BERT, tiny GLUE TSVs): the trainable share in
the log, the adapter folder and the merged model loading and predicting alike, two processes in bf16,
a bitwise exact resume, mode=eval of the export with and without merged weights and of a checkpoint,
and the refusals (a target that names no module; peft not installed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from app.config import ConfigError, LoraAdapterConfig
from tests.conftest import compose_config, run_app
from tests.helpers.metrics_rows import metrics_rows, without_throughput
from tests.helpers.tiny_bert import make_tiny_bert, make_tiny_glue_tsv, synthetic_pairs

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")


@pytest.fixture(scope="module")
def mrpc(tmp_path_factory) -> tuple[Path, Path]:
    """Tiny GLUE MRPC files and a tiny BERT whose vocabulary covers them."""
    root = tmp_path_factory.mktemp("lora_mrpc")
    data = make_tiny_glue_tsv(root / "data", n_train=64, n_val=21)
    model = make_tiny_bert(root / "bert", [s for _, a, b in synthetic_pairs(200, seed=3) for s in (a, b)])
    return data, model


def mrpc_args(mrpc: tuple[Path, Path], tmp_path: Path) -> tuple[str, ...]:
    data, model = mrpc
    return ("task=glue_mrpc", f"task.data_dir={data}", f"task.model={model}", f"task.cache_dir={tmp_path / 'cache'}",
            "task.max_length=48", "adapter=lora", "optim.lr=5e-3", "trainer.batch_size=8", "trainer.eval_batch_size=32",
            "early_stopping.monitor=eval/f1", "early_stopping.patience=null")


events = metrics_rows


def pairs(model_folder: Path) -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_folder)
    rows = synthetic_pairs(6, seed=9)
    return dict(tokenizer([a for _, a, _ in rows], [b for _, _, b in rows], padding=True, return_tensors="pt"))


def test_lora_targets_default_to_pefts_and_a_target_naming_nothing_is_refused(mrpc):
    from app.engine.adapters import attach_adapter, describe
    from app.engine.summary import model_summary
    from app.tasks import build_task
    from app.tasks.text.mean_pooling import MeanPoolingForSequenceClassification

    task = build_task(compose_config(*mrpc_args(mrpc, Path("unused"))).task)
    base = transformers.AutoModelForSequenceClassification.from_pretrained(mrpc[1])
    model = attach_adapter(base, LoraAdapterConfig(), task)
    assert describe(model) == ("BertForSequenceClassification with LoRA adapters (r=8, alpha=16, dropout=0.1) on "
                               "query, value")
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or ".classifier.modules_to_save." in n for n in trained)
    summary = model_summary(model, "cpu", "cpu", "no")
    share = float(re.search(r"trainable, ([\d.]+) %", summary).group(1))  # type: ignore[union-attr]
    assert 0 < share < 10 and "with LoRA adapters" in summary, summary

    # The mean-pooling head's model type is ours: peft's defaults come from its BERT encoder.
    encoder = transformers.AutoModel.from_pretrained(mrpc[1])
    pooled = attach_adapter(MeanPoolingForSequenceClassification.from_encoder(encoder, num_labels=2),
                            LoraAdapterConfig(), task)
    assert describe(pooled).endswith("on query, value")

    with pytest.raises(ConfigError) as refused:
        attach_adapter(transformers.AutoModelForSequenceClassification.from_pretrained(mrpc[1]),
                       LoraAdapterConfig(target_modules=["query", "qkv_proj"]), task)
    message = str(refused.value)
    assert message.startswith("adapter.target_modules has 'qkv_proj', which names no module of "
                              "BertForSequenceClassification") and "query, " in message and message.count(". ") == 0


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_mrpc_with_lora_on_two_processes_in_bf16_exports_an_adapter_and_a_merged_model_that_predict_alike(mrpc, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_app(*mrpc_args(mrpc, tmp_path), *QUIET, "hardware=multi_cpu", "hardware.num_processes=2",
                   "precision=bf16", "trainer.gradient_checkpointing=true", "trainer.max_steps=6",
                   "trainer.eval_every_n_steps=3", "checkpoint.every_n_steps=3", f"hydra.run.dir={run_dir}",
                   cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = (run_dir / "app.log").read_text()
    assert "gradient checkpointing: BertForSequenceClassification.activation_checkpointing_enable(use_reentrant=False)" in log
    summary = re.search(r"model BertForSequenceClassification with LoRA adapters \(r=8, alpha=16, dropout=0.1\) on "
                        r"query, value: [\d,]+ parameters \([\d,]+ trainable, ([\d.]+) %; [\d,]+ frozen\)", log)
    assert summary is not None, log[-3000:]
    evaluations = [e for e in events(run_dir) if "eval/f1" in e]
    assert [e["step"] for e in evaluations] == [3, 6] and all(e["eval/num_samples"] == 21 for e in evaluations)

    exported = run_dir / "model"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (exported / "adapter").iterdir()}
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(exported).eval()
    # PeftModel.from_pretrained puts the adapter into the model it is given: the pretrained one is loaded apart.
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForSequenceClassification.from_pretrained(mrpc[1]),
                                             exported / "adapter").eval()
    pretrained = transformers.AutoModelForSequenceClassification.from_pretrained(mrpc[1]).eval()
    batch = pairs(exported)
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, adapted(**batch).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(**batch).logits, pretrained(**batch).logits)  # the adapters did train
    # Frozen weights are exported as they were loaded; the adapted ones moved.
    assert torch.equal(merged.bert.embeddings.word_embeddings.weight, pretrained.bert.embeddings.word_embeddings.weight)
    assert not torch.equal(merged.bert.encoder.layer[0].attention.self.query.weight,
                           pretrained.bert.encoder.layer[0].attention.self.query.weight)

    card = (exported / "README.md").read_text()
    exported_step = json.loads((exported / "export.json").read_text())["step"]
    final = next(e for e in reversed(evaluations) if e["step"] == exported_step)
    for key in ("eval/accuracy", "eval/f1", "eval/loss"):
        assert f"| `{key}` | {final[key]:.4f} |" in card
    assert "| hardware | `multi_cpu`, 2 process(es) on cpu |" in card and "| precision | `bf16` |" in card
    assert "LoRA adapters (r=8, alpha=16, dropout=0.1) on query, value (merged into this folder's weights" in card


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_resumes_bitwise_and_mode_eval_reads_its_exports_and_checkpoints(mrpc, tmp_path, monkeypatch):
    from app.distributed.checkpoint.store import complete_checkpoints
    from app.engine.run import run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = (*mrpc_args(mrpc, tmp_path), *QUIET, "trainer.max_steps=6", "trainer.eval_every_n_steps=3",
            "checkpoint.every_n_steps=3", "checkpoint.every_epoch=false", "checkpoint.total_limit=null",
            "trainer.log_every_n_steps=2",
            # The final weights exported: the evaluations at steps 3 and 6 may tie, and the first of a tie
            # is the best, whose checkpoint the resumed run's folder does not hold.
            "checkpoint.export=last")
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run(compose_config(*args), reference)
    checkpoints = {m.step: path for path, m in complete_checkpoints(reference / "checkpoints")}
    # From step 3, into another folder, exporting the adapter alone this time.
    run(compose_config(*args, f"resume={checkpoints[3]}", "adapter.merge_on_export=false"), resumed)

    def files(run_dir: Path) -> dict:
        final = {m.step: m for _, m in complete_checkpoints(run_dir / "checkpoints")}[6]
        return {name: entry["sha256"] for name, entry in final.files.items() if name.startswith(("model", "optimizer"))}

    assert files(resumed) == files(reference) and len(files(reference)) == 2  # weights, adapters and AdamW moments
    later = [e for e in events(reference) if e["step"] > 3]
    assert without_throughput(later) == without_throughput(events(resumed))
    assert (resumed / "model" / "adapter" / "adapter_model.safetensors").read_bytes() == \
           (reference / "model" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert not (resumed / "model" / "model.safetensors").exists()

    final = [e for e in events(reference) if "eval/f1" in e][-1]
    for source in (reference / "model", resumed / "model", checkpoints[6]):
        out = tmp_path / f"eval-{source.parent.name}-{source.name}"
        out.mkdir()  # python -m app's Hydra makes the run folder; run() in-process expects it
        run(compose_config(*args, "mode=eval", f"resume={source}"), out)
        measured = json.loads((out / "eval_metrics.json").read_text())["metrics"]
        assert measured["eval/f1"] == final["eval/f1"] and measured["eval/accuracy"] == final["eval/accuracy"], source
        assert measured["eval/loss"] == pytest.approx(final["eval/loss"], rel=1e-5), source


def test_without_peft_adapter_lora_is_one_sentence_naming_the_extra(tmp_path):
    # peft hidden from the interpreter (as if not installed): a sitecustomize that blocks its import.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['peft'] = None\n")
    proc = run_app("adapter=lora", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120,
                   env={"PYTHONPATH": str(hide)})
    assert proc.returncode == 2
    assert proc.stderr.strip() == ('error: adapter=lora needs the peft package, which is not installed; pip install -e '
                                   '".[peft]" (or pip install peft), or use adapter=none.')
    assert not (tmp_path / "run").exists()


def test_a_bare_value_for_a_list_key_is_a_list_of_one(tmp_path):
    """``adapter.target_modules=all-linear`` as typed (peft's own spelling) is ``[all-linear]``, as is any
    list key given one value; a list, null and a sweep's values stay as they are."""
    from app.cli.argv import bare_values_as_lists

    proc = run_app("adapter=lora", "adapter.target_modules=all-linear", "logging.trackers=tensorboard", "--cfg", "job",
                   cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "  target_modules:\n  - all-linear\n" in proc.stdout and "  trackers:\n  - tensorboard\n" in proc.stdout
    kept = ["adapter.target_modules=[q,v]", "adapter.target_modules=null", "task.model=x"]
    assert bare_values_as_lists(kept) == kept
    assert bare_values_as_lists(["-m", "adapter.target_modules=q,v"]) == ["-m", "adapter.target_modules=q,v"]
    assert bare_values_as_lists(["+adapter.target_modules='q'"]) == ["+adapter.target_modules=['q']"]
