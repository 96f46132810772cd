"""What Transformers' ``*_no_trainer.py`` scripts rely on, compared with ``accelerate`` itself (a test-only
dependency): the same worker (tests/helpers/accelerate_parity_worker.py) runs on both packages, on 1 and 2
CPU processes, with the same ``set_seed``.

- ``accelerate.logging.get_logger``: ``main_process_only`` and ``in_order`` on 2 real processes, and
  ``ACCELERATE_LOG_LEVEL``;
- the random numbers a pass over a prepared loader consumes: one global draw per pass, shuffled or
  not, as a plain DataLoader (an MLM collator's masking and the next epoch's dropout depend on it);
- the batches each rank gets from a shuffled loader on 2 processes (the sampler's generator seeded
  as Accelerate seeds it), a second loader's own ``generator=``, a third loader seeded afresh;
- and our engine's ``seed=``, which on purpose draws nothing from the global RNG (exact resume).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from app.distributed import Accelerator
from app.distributed.utils import set_seed

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "helpers" / "accelerate_parity_worker.py"

pytest.importorskip("accelerate")


def run_worker(package: str, processes: int, folder: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Each rank's report and the log lines the ranks wrote (in the order they wrote them)."""
    out = folder / f"{package}-{processes}.json"
    # ACCELERATE_USE_CPU: `accelerate launch --cpu` (without it accelerate looks for GPUs under torchrun).
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    proc = subprocess.run([*launcher, str(WORKER), package, str(out)], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=150, check=False)
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(processes)
               if Path(f"{out}.{rank}").exists()]
    assert len(reports) == processes, f"{package} on {processes}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return reports, Path(f"{out}.log").read_text().splitlines()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], tuple[list[dict[str, Any]], list[str]]]:
    folder = tmp_path_factory.mktemp("parity")
    return {(package, n): run_worker(package, n, folder) for n in (1, 2) for package in ("app", "accelerate")}


def same_data(ours: dict[str, Any], theirs: dict[str, Any], key: str) -> None:
    assert ours[key] == theirs[key], f"rank {ours['rank']} of {ours['world']}: {key} differs from accelerate's"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("processes", [1, 2])
def test_unshuffled_loader_draws_once_per_pass_as_accelerate(runs, processes: int) -> None:
    for ours, theirs in zip(runs["app", processes][0], runs["accelerate", processes][0]):
        assert ours["rng_after_seed"] == theirs["rng_after_seed"]
        same_data(ours, theirs, "rng_after_prepare_unshuffled")
        same_data(ours, theirs, "unshuffled")  # batches and the RNG state after each pass
        first, second = ours["unshuffled"]["rng_after_pass"]
        assert ours["rng_after_prepare_unshuffled"] != first != second  # a draw in every pass


def test_unshuffled_loader_on_one_process_consumes_the_plain_loaders_draws() -> None:
    data = TensorDataset(torch.arange(10))

    def states_after_passes(loader: Any) -> list[torch.Tensor]:
        states = []
        for _ in range(2):
            for _batch in loader:
                pass
            states.append(torch.get_rng_state())
        return states

    set_seed(3)
    plain = states_after_passes(DataLoader(data, batch_size=4))
    set_seed(3)
    prepared = states_after_passes(Accelerator(cpu=True).prepare(DataLoader(data, batch_size=4)))
    assert all(torch.equal(a, b) for a, b in zip(plain, prepared))


def test_the_engines_seed_keeps_the_global_rng_untouched() -> None:
    """Ours on purpose: with ``Accelerator(seed=...)`` worker seeds come from (seed, epoch), so a run
    resumed mid-epoch consumes random numbers exactly as the uninterrupted one."""
    data = TensorDataset(torch.arange(10))
    acc = Accelerator(cpu=True, seed=4)
    loaders = [acc.prepare(DataLoader(data, batch_size=4)), acc.prepare(DataLoader(data, batch_size=4, shuffle=True))]
    set_seed(3)
    before = torch.get_rng_state()
    for loader in loaders:
        for _ in range(2):
            assert len(list(loader)) == 3
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("processes", [1, 2])
def test_shuffled_loaders_give_accelerates_batches_per_rank(runs, processes: int) -> None:
    for ours, theirs in zip(runs["app", processes][0], runs["accelerate", processes][0]):
        same_data(ours, theirs, "rng_after_prepare_shuffled")  # the generator's seed drawn as Accelerate's
        same_data(ours, theirs, "shuffled")
        same_data(ours, theirs, "third_shuffled")  # a later loader: seeded from a new draw
        same_data(ours, theirs, "seedable")  # use_seedable_sampler: data_seed + epoch, one draw per pass
        same_data(ours, theirs, "seedable_unshuffled")
        first, second = ours["shuffled"]["batches"]
        assert first != second  # reshuffled without set_epoch
    if processes == 2:
        (r0, r1) = runs["app", 2][0]
        seen = sorted(i for rank in (r0, r1) for batch in rank["shuffled"]["batches"][0] for i in batch)
        assert set(seen) == set(range(13)) and len(seen) == 18  # 13 samples in 3 global steps of 6


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("processes", [1, 2])
def test_a_second_loader_follows_its_own_generator(runs, processes: int) -> None:
    for ours, theirs in zip(runs["app", processes][0], runs["accelerate", processes][0]):
        same_data(ours, theirs, "own_generator")
    if processes == 1:
        # The order its generator gives a plain DataLoader, whatever loaders were prepared before.
        rows = TensorDataset(torch.arange(11))
        own = torch.Generator().manual_seed(7)
        plain = DataLoader(rows, batch_size=2, shuffle=True, generator=own)
        expected = [[b.tolist() for (b,) in plain] for _ in range(2)]
        assert runs["app", 1][0][0]["own_generator"]["batches"] == expected


def message(line: str) -> str:
    return line.split(" ", 3)[3]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_logger_keywords_on_two_processes_as_accelerate(runs) -> None:
    (_, ours), (_, theirs) = runs["app", 2], runs["accelerate", 2]
    keyword_lines = [line for line in ours if "parity.quiet" not in line.split(" ")[1]]
    # The same lines (prefix, name, caller, message); "every process" lines of the two ranks race.
    assert sorted(keyword_lines) == sorted(theirs)
    assert [message(line) for line in keyword_lines if "main process only" in line] == ["[RANK 0] main process only"]
    assert sorted(message(line) for line in keyword_lines if "every process" in line) == [
        "[RANK 0] every process 0", "[RANK 1] every process 1"]
    # in_order: rank 0's line is written before rank 1's, always.
    assert [message(line) for line in keyword_lines if "in order" in line] == ["[RANK 0] in order 0",
                                                                               "[RANK 1] in order 1"]
    assert all(line.startswith("INFO parity accelerate_parity_worker.py:main ") for line in keyword_lines)
    assert not any("below the level" in line for line in ours)
    # Rank 1's logger is set to ERROR: it logs nothing, yet joins the barriers (the run did not hang).
    assert [message(line) for line in ours if "parity.quiet" in line] == ["[RANK 0] in order, only where enabled 0"]


def test_get_logger_sets_the_level_from_accelerate_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate.logging

    from app.distributed.logging import get_logger

    root = logging.getLogger()
    saved = root.level
    try:
        monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "debug")
        ours, theirs = get_logger("parity.ours"), accelerate.logging.get_logger("parity.theirs")
        assert ours.logger.level == theirs.logger.level == logging.DEBUG == root.level
        ours, theirs = get_logger("parity.ours", log_level="error"), accelerate.logging.get_logger(
            "parity.theirs", log_level="error")
        assert ours.logger.level == theirs.logger.level == logging.ERROR == root.level
        monkeypatch.delenv("ACCELERATE_LOG_LEVEL")
        get_logger("parity.ours")  # no level given nor set: left as it is
        assert ours.logger.level == logging.ERROR
    finally:
        root.setLevel(saved)


def test_logging_before_any_state_raises_accelerates_error() -> None:
    from app.distributed.logging import get_logger
    from app.distributed.state import PartialState

    PartialState._reset_state()
    with pytest.raises(RuntimeError, match=r"calling either `PartialState\(\)` or `Accelerator\(\)`"):
        get_logger("parity").info("too early")
    Accelerator(cpu=True)
    get_logger("parity").info("fine now")


def test_the_names_no_trainer_scripts_import_resolve_module_for_module() -> None:
    """Transformers' no_trainer scripts (v4.49) import these, from accelerate, accelerate.logging and
    accelerate.utils; Accelerate's DeepSpeed example also imports its placeholders."""
    import accelerate

    from app.distributed import DistributedType
    from app.distributed.logging import get_logger
    from app.distributed.utils import DummyOptim, DummyScheduler, ProjectConfiguration

    assert sorted(m.name for m in DistributedType) == sorted(m.name for m in accelerate.DistributedType)
    assert not hasattr(DistributedType, "TPU")  # XLA since Accelerate 1.0, there and here
    assert callable(get_logger) and ProjectConfiguration().total_limit is None
    acc = Accelerator(cpu=True)
    # The scripts pick a real optimizer when there is no DeepSpeed config; a placeholder is refused.
    assert acc.state.deepspeed_plugin is None
    model = torch.nn.Linear(2, 2)
    placeholder = DummyOptim(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="DummyOptim, a placeholder for what a DeepSpeed config defines"):
        acc.prepare(model, placeholder)
    with pytest.raises(TypeError, match="pass a torch LR scheduler"):
        acc.prepare(DummyScheduler(placeholder, total_num_steps=10))
