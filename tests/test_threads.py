"""torch's intra-op threads per process (issue 29, item 12): the rule (``app/engine/threads.py``), its
line in the model summary, and ``hardware.num_threads`` over it. (Which choice is faster is measured in
``bench/threads.py``, not here.)"""

from __future__ import annotations

import logging

import torch

from app.engine.run import run
from app.engine.threads import SMALL_MODEL, ThreadChoice, choose_threads
from tests.conftest import compose_config


def test_the_rule_takes_the_config_else_one_thread_for_a_small_model_else_the_owned_cores_capped_by_omp():
    big = SMALL_MODEL
    assert choose_threads(3, 10, environ={"OMP_NUM_THREADS": "1"}, cores=8) == ThreadChoice(3, "hardware.num_threads")
    assert choose_threads(None, 17_226, environ={}, cores=8) == ThreadChoice(1, "small model")
    assert choose_threads(None, 17_226, environ={"OMP_NUM_THREADS": "4"}, cores=8) == ThreadChoice(1, "small model")
    assert choose_threads(None, big, environ={}, cores=8) == ThreadChoice(8, "the 8 cores this process owns")
    # OMP_NUM_THREADS caps it (torchrun's 1, joblib's share of the cores), never raises it.
    assert choose_threads(None, big, environ={"OMP_NUM_THREADS": "2"}, cores=8) == ThreadChoice(2, "OMP_NUM_THREADS")
    assert choose_threads(None, big, environ={"OMP_NUM_THREADS": "16"}, cores=8).count == 8
    # The machine's cores are shared among the run's processes on it (torchrun's LOCAL_WORLD_SIZE).
    assert choose_threads(None, big, environ={"LOCAL_WORLD_SIZE": "3"}, cores=8).count == 2
    assert str(choose_threads(None, big, environ={"LOCAL_WORLD_SIZE": "4"}, cores=2)) == \
        "1 thread (the core this process owns)"
    assert choose_threads(None, big, environ={"OMP_NUM_THREADS": ""}, cores=4).count == 4  # empty: unset


def test_a_run_uses_and_names_hardware_num_threads(tmp_path, caplog):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # so that 2 below is the run's doing
    try:
        with caplog.at_level(logging.INFO):
            run(compose_config("hardware.num_threads=2", "trainer.max_epochs=-1", "trainer.max_steps=2",
                               "trainer.limit_eval_batches=1", "checkpoint.every_epoch=false",
                               "checkpoint.save_final_model=false", "logging.trackers=[]",
                               "logging.progress_bar=false", "logging.print_config=false"), tmp_path)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    summary = next(r.getMessage() for r in caplog.records if "parameters (" in r.getMessage())
    assert "precision no, 2 threads (hardware.num_threads); run folder" in summary, summary
