"""Coming from TRL: every option of TRL 1.16's ``SFTConfig``, ``DPOConfig``, ``GRPOConfig`` and
``RewardConfig`` (and so of Transformers' ``TrainingArguments``) has its answer in ``app/cli/trl_names.py``,
each key it names is a real key or option, docs/coming-from-trl.md gives the same answers, and a TRL name
typed as a key is refused with our key in the sentence, the keys hint naming the chosen task (``python -m
app task=sft --cfg job``), not the default one."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from app.cli.help import run_keys
from app.cli.hydra_errors import composition_sentence
from app.cli.job import command_choices
from app.cli.trl_names import TRL_NAMES, Counterpart
from app.tasks import TASK_SCHEMAS
from tests.conftest import CONF_DIR, REPO, compose_many

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

PAGE = REPO / "docs" / "coming-from-trl.md"


def fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def page_sections() -> dict[str, dict[str, str]]:
    """Each ``## section`` of the page: its table's rows, TRL's name -> our cell."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].split()[0], {})
        elif row := re.match(r"\| `(\w+)` \| (.+) \|$", line):
            current[row.group(1)] = row.group(2)
    return sections


CONFIGS = (trl.SFTConfig, trl.DPOConfig, trl.GRPOConfig, trl.RewardConfig)
"""TRL's configs the table and the page answer for, in the page's order."""


def test_the_table_answers_every_option_of_trls_configs():
    names = set().union(*(fields(cls) for cls in CONFIGS))
    assert names - set(TRL_NAMES) == set()
    assert set(fields(transformers.TrainingArguments)) <= names


def test_each_key_the_table_names_is_a_key_or_option_of_ours():
    keys = set(run_keys(CONF_DIR, {"adapter": "lora"}))
    for task in TASK_SCHEMAS:
        keys |= set(run_keys(CONF_DIR, {"task": task}))
    with_values = []
    for name, counterpart in TRL_NAMES.items():
        key, _, value = counterpart.key.partition("=")
        if not key or key.startswith("hydra.") or key.endswith(".<key>"):
            continue
        if key in keys:
            if value:
                with_values.append(counterpart.key)
        else:  # a group's option: precision=bf16
            assert value and (CONF_DIR / key / f"{value}.yaml").is_file(), (name, counterpart.key)
    compose_many([["task=dpo", override] for override in sorted(set(with_values))])  # each value is one of ours


def cell(counterpart: Counterpart) -> str:
    """The page's answer for one of TRL's options: our key (and its note), what happens instead, or not yet."""
    if counterpart.key:
        return f"`{counterpart.key}`" + (f" ({counterpart.note})" if counterpart.note else "")
    return f"no key: {counterpart.note}" if counterpart.note else "not yet"


PAGE_ONLY = {("SFTConfig", "loss_type"): "no key: the loss is nll; dft not yet",
             ("GRPOConfig", "beta"): "`task.beta` (task=grpo's: the weight of the KL term to task.reference)",
             ("GRPOConfig", "loss_type"): "`task.loss_type` (task=grpo's: dapo, grpo, dr_grpo, bnpo)"}
"""Where the page answers for one trainer and the table (which cannot tell the trainers apart) for another:
GRPO's beta and loss_type are task=grpo's, not task=dpo's; TRL's SFT loss_type is nll or dft."""


def test_the_page_gives_the_tables_answers_for_every_option():
    sections = page_sections()
    training_arguments = fields(transformers.TrainingArguments)
    assert list(sections["TrainingArguments"]) == training_arguments
    for cls in CONFIGS:
        assert list(sections[cls.__name__]) == [n for n in fields(cls) if n not in training_arguments], cls.__name__
    for section, rows in sections.items():
        for name, answer in rows.items():
            assert answer == PAGE_ONLY.get((section, name), cell(TRL_NAMES[name])), (section, name)


def refusals(*cases: list[str]) -> list[str]:
    """The sentence each ``python -m app <overrides>`` ends with when Hydra refuses to compose it (one Hydra
    initialisation for all: much faster than a process each; tests/test_bad_inputs.py runs one as typed)."""
    sentences = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for overrides in cases:
            try:
                compose(config_name="config", overrides=overrides)
            except ConfigCompositionException as err:
                sentences.append(composition_sentence(err, **command_choices(overrides)))
            else:
                raise AssertionError(f"{overrides} composed")
    return sentences


TYPED = {"learning_rate=1e-5": "optim.lr", "task.max_length=128": "task.block_size",
         "trainer.per_device_train_batch_size=4": "trainer.batch_size", "trainer.save_steps=10": "checkpoint.every_n_steps",
         "bf16=true": "precision=bf16", "warmup_ratio=0.1": "scheduler.warmup_ratio",
         "trainer.max_grad_norms=1": "trainer.max_grad_norm"}
"""A few of the issue's names (each composition costs Hydra ~0.5 s; the table's keys are checked above)."""


def test_a_trl_name_typed_as_a_key_gets_ours_and_the_chosen_tasks_keys_hint():
    for (typed, ours), sentence in zip(TYPED.items(), refusals(*(["task=sft", typed] for typed in TYPED)), strict=True):
        key = typed.split("=")[0]
        name = key.rpartition(".")[2]
        # Ours of the same name (warmup_ratio) as a "did you mean"; else TRL's answer; else the closest spelling.
        assert sentence.startswith((f"unknown configuration key {key}: TRL's {name} is {ours} here (",
                                    f"unknown configuration key {key}; did you mean {ours}? ")), sentence
        assert sentence.endswith(" python -m app task=sft --cfg job lists the keys."), sentence


def test_a_key_of_another_task_or_group_says_where_it_is():
    assert refusals(["task=sft", "task.chosen_field=better"], ["task=glue_mrpc", "max_length=64"],
                    ["task=digits", "max_length=64"]) == [
        ("unknown configuration key task.chosen_field: it is a key of task=dpo, task=kto and task=reward_model, not "
         "of task=sft; python -m app task=sft --cfg job lists the keys."),
        ("unknown configuration key max_length; did you mean task.max_length? python -m app task=glue_mrpc --cfg job "
         "lists the keys."),
        ("unknown configuration key max_length: TRL's max_length is task.block_size here (task=causal_lm, task=sft, "
         "task=dpo, task=kto, task=grpo and task=reward_model; docs/coming-from-trl.md); python -m app task=digits "
         "--cfg job lists the keys.")]
