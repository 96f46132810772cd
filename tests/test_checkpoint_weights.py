"""``Accelerator.save_weights`` / ``load_weights``: a model's weights alone, committed like a checkpoint
(temporary folder, manifest last, rename), in the background too, frozen parameters left out on
request; a folder that is no checkpoint and is refused as one."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from torch import nn

from app.distributed import Accelerator
from app.distributed.checkpoint import store
from app.distributed.checkpoint.errors import CheckpointError
from app.distributed.checkpoint.training_state import holds_weights_only


def model_with_a_frozen_layer() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    return model


def saved_keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.timeout(60)
def test_weights_are_committed_alone_and_load_back_leaving_what_was_left_out(tmp_path):
    acc = Accelerator(cpu=True, project_dir=tmp_path)
    model = acc.prepare(model_with_a_frozen_layer())
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    folder = acc.save_weights(model, tmp_path / "checkpoints" / "best_3", trainable_only=True,
                              metadata={"step": 3, "metric": {"name": "eval/loss", "value": 0.5, "mode": "min"}},
                              async_save=True)
    acc.wait_for_checkpoint()
    manifest = store.read_manifest(folder)
    assert store.verify(folder) is None and holds_weights_only(manifest)
    assert (manifest.step, manifest.metric["value"], sorted(manifest.files)) == (3, 0.5, ["model.safetensors"])
    # The frozen layer is left out; the trained ones and the buffers (BatchNorm's statistics) are kept.
    assert saved_keys(folder) == {k for k in at_save if not k.startswith("0.")}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model[1].running_mean.add_(1.0)
    acc.load_weights(model, folder)
    after = model.state_dict()
    assert all(torch.equal(after[k], at_save[k]) for k in at_save if not k.startswith("0."))
    assert all(torch.equal(after[k], at_save[k] + 1) for k in ("0.weight", "0.bias"))  # left as it was

    # Written again: replaced whole, never two folders of one name.
    acc.save_weights(model, folder, metadata={"step": 3})
    assert saved_keys(folder) == set(at_save) and store.verify(folder) is None


@pytest.mark.timeout(60)
def test_a_weights_folder_is_no_checkpoint_and_a_tampered_one_is_refused(tmp_path):
    acc = Accelerator(cpu=True, project_dir=tmp_path)
    model = acc.prepare(model_with_a_frozen_layer())
    folder = acc.save_weights(model, tmp_path / "checkpoints" / "best_7", metadata={"step": 7})
    assert store.complete_checkpoints(tmp_path / "checkpoints") == []  # never listed, chosen or rotated as one
    with pytest.raises(CheckpointError, match=r"holds only the weights of the evaluation at step 7 .*cannot continue"):
        acc.load_state(folder)
    checkpoint = acc.save_state()
    with pytest.raises(CheckpointError, match=r"it is a checkpoint, not a folder of weights"):
        acc.load_weights(model, checkpoint)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"cannot load the weights in .*best_7: model.safetensors does not match"):
        acc.load_weights(model, folder)
