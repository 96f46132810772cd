"""Checkpoint files without pickle: our safetensors writer, nested states, shared tensors."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from app.distributed.checkpoint.format import (
    dedupe_shared,
    finish,
    flatten,
    unflatten,
    write_safetensors,
    write_state,
)
from app.distributed.checkpoint.store import read_state


@pytest.mark.timeout(30)
def test_written_files_are_standard_safetensors_with_the_recorded_hash(tmp_path):
    # finish() hashes the bytes from memory: the digest must be the file's.
    tensors = {
        "w": torch.randn(3, 5), "half": torch.randn(4).half(), "bf": torch.randn(2, 2).bfloat16(),
        "ids": torch.arange(7), "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3), "view": torch.randn(4, 6).t(),  # non-contiguous
    }
    path = tmp_path / "t.safetensors"
    digest = finish({"t": write_safetensors(path, tensors, {"format": "pt", "note": "x"})})["t"]
    assert digest.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest.size == path.stat().st_size
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}


@pytest.mark.timeout(30)
def test_optimizer_state_round_trips_through_json_and_tensors(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    state["extra"] = {"nan": math.nan, "inf": -math.inf, "tuple": (1, "a", None), "__odd": 3}
    files = write_state(tmp_path, "optimizer", state)
    assert list(files) == ["optimizer.safetensors"]
    back = read_state(tmp_path, "optimizer")
    assert back["param_groups"] == state["param_groups"]  # int param ids, tuple betas survive
    assert set(back["state"]) == {0, 1}
    for pid in (0, 1):
        for key, value in state["state"][pid].items():
            assert torch.equal(back["state"][pid][key], value)
    assert math.isnan(back["extra"]["nan"]) and back["extra"]["inf"] == -math.inf
    assert back["extra"]["tuple"] == (1, "a", None) and back["extra"]["__odd"] == 3
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())
    fresh.load_state_dict(back)


@pytest.mark.timeout(30)
def test_state_without_tensors_is_plain_json(tmp_path):
    files = write_state(tmp_path, "scheduler", {"last_epoch": 3, "base_lrs": [0.1]})
    assert list(files) == ["scheduler.json"]
    assert json.loads((tmp_path / "scheduler.json").read_text()) == {"last_epoch": 3, "base_lrs": [0.1]}


def test_objects_that_would_need_pickle_are_refused():
    with pytest.raises(TypeError, match="without pickle"):
        flatten({"fn": lambda: 1})
    skeleton, tensors = flatten({"a": [torch.ones(1), {"b": torch.zeros(2)}]})
    assert set(tensors) == {"a.0", "a.1.b"}
    assert torch.equal(unflatten(skeleton, tensors)["a"][1]["b"], torch.zeros(2))


def test_tied_tensors_are_stored_once_and_views_are_cloned():
    weight = torch.randn(4, 3)
    other = torch.randn(10)
    tensors = {"emb": weight, "head": weight, "first": other[:5], "second": other[5:]}
    unique, aliases = dedupe_shared(tensors)
    assert aliases == {"head": "emb"} and set(unique) == {"emb", "first", "second"}
    assert unique["first"].untyped_storage().data_ptr() != unique["second"].untyped_storage().data_ptr()
    # A Transformers model names the tie targets: those are the ones left out.
    unique, aliases = dedupe_shared({"emb": weight, "head": weight}, drop_first={"emb"})
    assert aliases == {"emb": "head"}
