"""``model/README.md``: every export's model card, read back as a reader (and the Hub) reads it: YAML
metadata with the licence left to set, then the evaluation of the exported weights, the data's split
sizes, the hyperparameters and how the run computed. (The command that reproduces a run and a sweep
job's place: tests/test_mlflow.py's sweep; a LoRA export's card: tests/test_adapters.py.)"""

from __future__ import annotations

import json

import yaml

from app.engine.progress import human
from app.engine.run import run
from tests.conftest import compose_config


def sections(card: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    current = ""
    for line in card.splitlines():
        if line.startswith("## "):
            current = line[3:]
            found[current] = []
        elif current:
            found[current].append(line)
    return found


def rows(lines: list[str]) -> dict[str, str]:
    """A two-column markdown table's rows (header and rule skipped), cells unquoted."""
    cells = [[c.strip().replace("`", "") for c in line.strip("|").split(" | ")] for line in lines if line.startswith("| ")]
    return {a: b for a, b in cells[2:]}


def test_an_export_has_a_model_card_with_the_evaluation_of_the_exported_weights(tmp_path):
    run_dir = tmp_path / "run"
    # checkpoint.export resolves to best: the card's table is the exported evaluation's, whichever step it was.
    run(compose_config("trainer.max_steps=30", "trainer.eval_every_n_steps=10", "checkpoint.every_n_steps=10",
                       "checkpoint.every_epoch=false", "optim.lr=0.05", "precision=bf16", "logging.trackers=[]",
                       "logging.progress_bar=false", "logging.print_config=false"), run_dir)
    card = (run_dir / "model" / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    meta = yaml.safe_load(front)
    assert meta["license"] is None and "# yours to set" in front  # left for the user
    assert meta["tags"] == ["app", "digits"] and meta["metrics"] == ["accuracy", "f1"]

    export = json.loads((run_dir / "model" / "export.json").read_text())
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at_export = next(e for e in logged if e["step"] == export["step"] and "eval/accuracy" in e)
    parts = sections(body)
    evaluation = rows(parts["Evaluation"])
    assert set(evaluation) == {k for k in at_export if k.startswith("eval/")}
    assert all(evaluation[k] == human(v) for k, v in at_export.items() if k.startswith("eval/"))
    assert rows(parts["Data"]) == {"train": "1,437", "evaluation": "360"}
    training = rows(parts["Training"])
    assert training["precision"] == "bf16" and training["hardware"] == "cpu, 1 process(es) on cpu"
    assert training["batch"] == "32 per process × 1 process(es) × 1 accumulation = 32" and training["seed"] == "42"
    assert rows(parts["Model"])["task"] == "digits" and "trained from scratch" in rows(parts["Model"])["base model"]
    assert "started without Hydra's command line" in "\n".join(parts["Reproduce"])
    assert parts["License"][1].startswith("Not set.")
