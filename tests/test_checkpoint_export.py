"""``Accelerator.save_model`` and the final export: files transformers' ``from_pretrained`` loads."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from app.distributed import Accelerator
from tests.conftest import run_app

transformers = pytest.importorskip("transformers")


def tiny_bert_config(**kwargs):
    return transformers.BertConfig(vocab_size=99, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=32, max_position_embeddings=32, **kwargs)


def inputs():
    return {"input_ids": torch.randint(0, 99, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}


@pytest.mark.timeout(120)
def test_sharded_export_loads_with_from_pretrained_and_later_saves_clean_up(tmp_path):
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(tiny_bert_config(num_labels=2)).eval()
    acc = Accelerator(cpu=True)
    folder = tmp_path / "export"
    acc.save_model(model, folder, max_shard_size="8KB")
    model.config.save_pretrained(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(model.state_dict()) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    batch = inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)

    acc.save_model(model, folder)  # one file now: the shards and the index go
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    transformers.AutoModelForSequenceClassification.from_pretrained(folder)


@pytest.mark.timeout(120)
def test_tied_weights_are_stored_once_and_retied_on_load(tmp_path, caplog):
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(tiny_bert_config(tie_word_embeddings=True)).eval()
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    folder = tmp_path / "mlm"
    with caplog.at_level(logging.WARNING):
        Accelerator(cpu=True).save_model(model, folder)
    model.config.save_pretrained(folder)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "bert.embeddings.word_embeddings.weight" in keys
    assert "cls.predictions.decoder.weight" not in keys and "missing" not in caplog.text
    loaded = transformers.AutoModelForMaskedLM.from_pretrained(folder).eval()
    batch = inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)


def test_untied_module_sharing_memory_and_pickle_format(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    acc = Accelerator(cpu=True)
    with caplog.at_level(logging.WARNING):
        acc.save_model(model, tmp_path / "a")
    assert "1.weight" in caplog.text  # said out loud: it must be tied again after loading
    acc.save_model(model, tmp_path / "b", safe_serialization=False)
    state = torch.load(tmp_path / "b" / "pytorch_model.bin", weights_only=True)
    assert torch.equal(state["0.weight"], model[0].weight) and "1.weight" not in state
    with pytest.raises(ValueError, match="max_shard_size"):
        acc.save_model(model, tmp_path / "c", max_shard_size="ten gigs")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_glue_run_exports_a_folder_from_pretrained_loads(tmp_path):
    from tests.helpers.tiny_bert import make_tiny_bert, make_tiny_glue_tsv, synthetic_pairs

    data = make_tiny_glue_tsv(tmp_path / "data", n_train=32, n_val=8)
    sentences = [s for _, s1, s2 in synthetic_pairs(100, seed=9) for s in (s1, s2)]
    model_dir = make_tiny_bert(tmp_path / "tiny_bert", sentences)
    run_dir = tmp_path / "run"
    run_app("task=glue_mrpc", f"task.model={model_dir}", f"task.data_dir={data}", f"task.cache_dir={tmp_path / 'c'}",
            "task.max_length=32", "trainer.max_epochs=1", "trainer.batch_size=8", "logging.trackers=[]",
            "logging.progress_bar=false", f"hydra.run.dir={run_dir}", cwd=tmp_path, check=True)
    export = run_dir / "model"
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(export)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert loaded.config.id2label == {0: "not_equivalent", 1: "equivalent"}
    from safetensors.torch import load_file

    # The export holds the trained weights of the run's last checkpoint (every_epoch by default).
    final = load_file(str(export / "model.safetensors"))
    checkpoint = load_file(str(run_dir / "checkpoints" / "checkpoint_0" / "model.safetensors"))
    assert all(torch.equal(final[k], checkpoint[k]) for k in final)
    assert tokenizer("a b", "c")["input_ids"]
