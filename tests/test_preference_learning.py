"""Every objective learns the toy preference (the chosen answer keeps the grammar's subject/verb rule, the
rejected one breaks it) in 30 optimizer steps of a tiny Llama, as ``python -m app`` runs it: task=dpo's
every ``task.loss_type`` reaches ``eval/rewards/accuracies`` ≥ 0.9 on held-out pairs; task=kto's losses
rate the held-out good answers above the bad ones (``eval/rewards/chosen`` > ``rewards/rejected``).

Two settings differ from the rest, for what the objectives are: ``apo_down`` lowers both answers'
likelihood and the rejected one's more, whose margin grows slowly (a larger learning rate); DiscoPOP's
loss rises with the margin around 0 at its paper's τ = 0.05 (its slope there is +0.78 per unit of β·m),
so from policy = reference it first pulls the margins below 0 and settles there: τ = 1 starts it downhill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.tasks.dpo.config import LossType
from app.tasks.kto.config import KTOLoss
from tests.helpers.dpo_pairs import kto_rows, preference_rows
from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl

OPTIONS = {LossType.exo_pair: ("task.label_smoothing=1e-3",), LossType.apo_down: ("optim.lr=1e-2",),
           LossType.discopop: ("task.discopop_tau=1.0",)}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("learning")
    make_tiny_chat_llama(root / "model")
    write_jsonl(root / "prefs.jsonl", preference_rows(160))
    write_jsonl(root / "feedback.jsonl", kto_rows(240, seed=1))
    write_jsonl(root / "val.jsonl", preference_rows(40, seed=7))
    return root


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("objective", [*LossType, *KTOLoss], ids=lambda o: f"{type(o).__name__}.{o.value}")
def test_each_objective_learns_the_toy_preference(data, objective):
    from app.engine.run import run
    from tests.conftest import compose_config

    kto = isinstance(objective, KTOLoss)
    train = data / ("feedback.jsonl" if kto else "prefs.jsonl")
    options = OPTIONS.get(objective, ()) if isinstance(objective, LossType) else ()
    folder = data / f"run-{objective.value}-{'kto' if kto else 'dpo'}"
    cfg = compose_config(f"task={'kto' if kto else 'dpo'}", f"task.loss_type={objective.value}",
                         f"task.config={data / 'model'}", f"task.data_files.train={train}",
                         f"task.data_files.validation={data / 'val.jsonl'}", f"task.cache_dir={data / 'cache'}",
                         "task.block_size=128", "trainer.max_steps=30", "trainer.eval_every_n_steps=30",
                         "trainer.max_epochs=20", *(("optim.lr=1e-3",) if "optim.lr=1e-2" not in options else ()),
                         "scheduler=constant", "checkpoint.every_epoch=false", "checkpoint.save_final_model=false",
                         "early_stopping.patience=null", "logging.trackers=[]", "logging.progress_bar=false",
                         "logging.print_config=false", *options, f"hydra.run.dir={folder}")
    run(cfg, folder)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "eval/loss" in r][-1]
    if kto:
        assert last["eval/rewards/chosen"] > last["eval/rewards/rejected"]
    else:
        assert last["eval/rewards/accuracies"] >= 0.9 and last["eval/rewards/margins"] > 0
