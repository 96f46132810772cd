"""``hardware.sharding=fsdp`` against the replicated layout, in one process over every XLA device
(tests/test_xla.py runs it with ``CPU_NUM_DEVICES=4``): the same model and batches trained both
ways, and each layout's checkpoint continued by the other. Prints one JSON object:

- ``losses``: per layout, the loss of every step;
- ``specs``: the sharding of a weight and of its AdamW state, per layout, after training;
- ``crossed``: the losses of 3 more steps of each layout resumed from the other one's checkpoint,
  and ``straight``: the same 3 steps continued without a checkpoint;
- ``after_load``: the sharding of that weight after the sharded layout loaded the replicated checkpoint.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python -m tests.helpers.xla_sharding_run <folder>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from app.config import MeshSharding
from app.distributed import Accelerator
from app.distributed.backends.xla_spmd import XlaSpmdBackend

STEPS, MORE = 6, 3


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 24, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(n)]


def spec(tensor: torch.Tensor) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def prepared(sharding: MeshSharding) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 5))
    acc = Accelerator(backend=XlaSpmdBackend(sharding=sharding), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    return acc, model, optimizer


def train(acc: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer,
          data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in data:
        x, y = acc.backend.place_batch((x, y))
        loss = nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return [float(loss.item()) for loss in losses]  # read once, at the end: no host sync per step


def main(folder: Path) -> None:
    data = batches(STEPS + MORE)
    result: dict[str, dict[str, object]] = {"losses": {}, "specs": {}, "crossed": {}, "straight": {}}
    for sharding in MeshSharding:
        acc, model, optimizer = prepared(sharding)
        result["losses"][sharding.value] = train(acc, model, optimizer, data[:STEPS])
        weight = model[0].weight
        result["specs"][sharding.value] = [spec(weight), spec(optimizer.state[weight]["exp_avg"])]
        acc.save_state(folder / sharding.value)
        result["straight"][sharding.value] = train(acc, model, optimizer, data[STEPS:])
    for sharding, other in ((MeshSharding.fsdp, MeshSharding.replicated), (MeshSharding.replicated, MeshSharding.fsdp)):
        acc, model, optimizer = prepared(sharding)
        acc.load_state(folder / other.value)
        if sharding is MeshSharding.fsdp:
            result["after_load"] = {"weight": spec(model[0].weight)}
        result["crossed"][sharding.value] = train(acc, model, optimizer, data[STEPS:])
    print(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
