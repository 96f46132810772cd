"""``python -m app task=glue_mrpc`` end to end: two processes, bf16, the real validation split when
it is present, throughput (tokens/s, MFU) in ``metrics.jsonl``, and the exported model loading back
with ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import SHARED_DATA, run_app
from tests.helpers.tiny_bert import make_tiny_bert, make_tiny_glue_tsv, synthetic_pairs

REAL_MRPC = SHARED_DATA / "glue_mrpc"


def real_sentences(limit: int = 600) -> list[str]:
    rows = (REAL_MRPC / "train.tsv").read_text(encoding="utf-8").splitlines()[1 : limit + 1]
    return [s for row in rows for s in row.split("\t")[3:5]]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("options", [
    ["hardware=multi_cpu"],
    # The MiniLM recipe's choices: mean pooling (no unused pooler for DDP), length-grouped batches, a
    # weight average, both-order evaluation, test predictions, frozen word embeddings; and the
    # mean-pooling model sharded by FSDP2 (frozen and trained parameters in one sharded group).
    ["hardware=multi_cpu", "task.pooling=mean", "trainer.group_by_length=true", "trainer.ema_decay=0.9",
     "task.symmetric_eval=true", "task.predict_test=true", "optim.freeze=[word_embeddings]"],
    ["hardware=fsdp", "task.pooling=mean", "optim.freeze=[word_embeddings]"],
], ids=["ddp-cls", "ddp-mean-grouped", "fsdp-mean"])
def test_glue_mrpc_on_two_processes_in_bf16_gathers_every_validation_pair(tmp_path, options):
    if REAL_MRPC.is_dir():
        data_dir, expected = REAL_MRPC, 408
        sentences = real_sentences()
    else:  # a fresh machine without ../shared: the same path on tiny synthetic files
        data_dir, expected = make_tiny_glue_tsv(tmp_path / "data", n_train=64, n_val=21, n_test=8), 21
        sentences = [s for _, a, b in synthetic_pairs(200, seed=3) for s in (a, b)]
    model = make_tiny_bert(tmp_path / "tiny_bert", sentences)
    run_dir = tmp_path / "run"
    run_app(f"hydra.run.dir={run_dir}", "task=glue_mrpc", f"task.data_dir={data_dir}", f"task.model={model}",
            f"task.cache_dir={tmp_path / 'cache'}", "task.max_length=64", *options,
            "hardware.num_processes=2", "precision=bf16", "trainer.max_steps=6", "trainer.eval_every_n_steps=3",
            "trainer.batch_size=8", "trainer.eval_batch_size=32", "trainer.log_every_n_steps=2",
            "hardware.peak_tflops=1", "logging.trackers=[]", "logging.progress_bar=false", cwd=tmp_path,
            check=True, timeout=380)

    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if "eval/f1" in e]
    assert [e["step"] for e in evals] == [3, 6]
    # De-duplicated across the 2 ranks: exactly the validation split, no padding duplicates.
    assert all(e["eval/num_samples"] == expected for e in evals)
    assert all(0.0 <= e["eval/accuracy"] <= 1.0 and "eval/loss" in e for e in evals)
    # Throughput: non-padding tokens of both ranks (several per pair), MFU against the given peak.
    trains = [e for e in events if "train/loss" in e]
    assert [e["step"] for e in trains] == [2, 4, 6]
    assert all(e["train/tokens_per_s"] > 5 * e["train/samples_per_s"] > 0 and 0 < e["train/mfu"] < 1 for e in trains)
    assert "; throughput mean " in (run_dir / "app.log").read_text()

    if "task.predict_test=true" in options:  # one row per test pair, in the file's order
        rows = (run_dir / "test_predictions.tsv").read_text().splitlines()
        test_rows = (data_dir / "test.tsv").read_text(encoding="utf-8").splitlines()[1:]
        assert rows[0] == "index\tprediction" and len(rows) == 1 + len(test_rows)
        assert [r.split("\t")[0] for r in rows[1:]] == [str(i) for i in range(len(test_rows))]
        assert {r.split("\t")[1] for r in rows[1:]} <= {"0", "1"}

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    exported = Path(run_dir / "model")
    mean_pooling = "task.pooling=mean" in options  # its head ships as code next to the weights
    loaded = AutoModelForSequenceClassification.from_pretrained(exported, trust_remote_code=mean_pooling)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert loaded.config.num_labels == 2
    batch = tokenizer(["A sentence."], ["Another sentence."], return_tensors="pt")
    assert loaded(**batch).logits.shape == (1, 2)

    if "optim.freeze=[word_embeddings]" in options:  # exported as loaded; the layers above it trained
        from transformers import AutoModel

        pretrained = AutoModel.from_pretrained(model)
        assert torch.equal(loaded.encoder.embeddings.word_embeddings.weight,
                           pretrained.embeddings.word_embeddings.weight)
        assert not torch.equal(loaded.encoder.encoder.layer[0].attention.self.query.weight,
                               pretrained.encoder.layer[0].attention.self.query.weight)
