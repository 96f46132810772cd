"""``notebook_launcher``: a training function started from a plain Python process (as from a
notebook) on 2 forked CPU processes, with a model built outside it; and the one-process path."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from app.distributed import Accelerator, notebook_launcher
from app.workers.elastic import free_port, local_port, port_is_free
from tests.conftest import REPO

# The user's script: the model is built once in the parent and reaches both processes through
# ``args``; each rank trains 3 SGD steps on its own batches. DDP averages the gradients, so both
# ranks must end with the weights of one process that trains on both ranks' batches.
SCRIPT = """
import json, sys
import torch
from app.distributed import Accelerator, notebook_launcher

def batch(rank, step):
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank))

def train(model, steps):
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(steps):
        loss = (model(batch(accelerator.process_index, step).to(accelerator.device)) - 1).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    weight = accelerator.unwrap_model(model).weight.detach().cpu()
    result = {"rank": accelerator.process_index, "num_processes": accelerator.num_processes,
              "distributed_type": accelerator.distributed_type, "weight": weight.tolist()}
    accelerator.end_training()
    return result

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
initial = model.weight.detach().clone()
results = notebook_launcher(train, args=(model, 3), num_processes=2, use_port=sys.argv[1])

reference = torch.nn.Linear(4, 2)
reference.load_state_dict(model.state_dict())
optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
for step in range(3):
    loss = sum((reference(batch(rank, step)) - 1).pow(2).mean() for rank in range(2)) / 2
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(json.dumps({"results": results, "reference": reference.weight.detach().tolist(),
                  "parent_untouched": torch.equal(model.weight, initial), "initial": initial.tolist()}))
"""


@pytest.mark.timeout(120)
def test_two_forked_processes_train_a_model_built_outside(tmp_path: Path) -> None:
    script = tmp_path / "notebook.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # The port asked for is taken (a previous launch, another job on 29500): on one machine the
    # launcher takes a free one instead of failing with EADDRINUSE.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = subprocess.run([sys.executable, str(script), str(taken.getsockname()[1])], check=False,
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    results = out["results"]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["num_processes"] == 2 and r["distributed_type"] == "MULTI_CPU" for r in results)
    assert results[0]["weight"] == results[1]["weight"]  # DDP kept the ranks in step
    flat = [w for row in results[0]["weight"] for w in row]
    assert flat == pytest.approx([w for row in out["reference"] for w in row], abs=1e-6)  # averaged gradients
    assert results[0]["weight"] != out["initial"]
    assert out["parent_untouched"]  # each process trained its own (forked) copy


def test_one_process_runs_the_function_here_with_the_precision_as_default() -> None:
    def train(x: int) -> tuple[int, int, str]:
        accelerator = Accelerator(cpu=True)
        return x * 2, accelerator.num_processes, accelerator.mixed_precision

    assert notebook_launcher(train, args=(21,), mixed_precision="bf16") == [(42, 1, "bf16")]
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ or os.environ["ACCELERATE_MIXED_PRECISION"] != "bf16"
    with pytest.raises(ValueError, match="Unknown mixed_precision mode 'fp8'"):
        notebook_launcher(train, args=(1,), mixed_precision="fp8")


def test_a_busy_port_is_swapped_for_a_free_one_and_a_free_one_is_kept() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        assert not port_is_free("127.0.0.1", busy)
        chosen = local_port("127.0.0.1", busy)
        assert chosen != busy and port_is_free("127.0.0.1", chosen)
    wanted = free_port()
    assert local_port("127.0.0.1", wanted) == wanted
