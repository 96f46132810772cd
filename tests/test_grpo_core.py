"""``task=grpo``'s schema, before the task: composed through Hydra (rewards as a list of free-form entries) and
read; bad values refused in one sentence."""

from __future__ import annotations

import pytest

from app.config import ConfigError
from app.tasks.grpo.config import GRPOConfig, GRPOLoss, ScaleRewards
from tests.conftest import CONF_DIR

# -- the schema ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_grpo():
    """Compose the app's real config with ``task=grpo_schema`` (GRPOConfig, stored as the other task
    schemas are; not yet an option of conf/task), then remove it from the ConfigStore."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from app.cli.configure import schema_node, to_run_config

    store = ConfigStore.instance()
    store.store(group="task", name="grpo_schema", node=schema_node(GRPOConfig))
    base = ["task=grpo_schema", "task.model=m", "task.data_files.train=prompts.jsonl"]

    def composed(*overrides: str):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return to_run_config(compose(config_name="config", overrides=[*base, *overrides])).task

    yield composed
    store.repo["task"].pop("grpo_schema.yaml")


def test_rewards_compose_as_free_entries_and_are_read(compose_grpo):
    task = compose_grpo("task.rewards=[{_target_: my_rewards.exact_answer}, {_target_: my_rewards.format, "
                        "weight: 0.2, pattern: '^<a>', options: {x: [1, 2]}}, {reward_model: /m/rm, name: judge}]",
                        "task.num_generations=4", "task.loss_type=dr_grpo", "task.scale_rewards=none")
    assert isinstance(task, GRPOConfig)
    task.check()
    specs = task.reward_specs()
    assert [(s.name, s.weight, s.target, s.reward_model) for s in specs] == [
        ("exact_answer", 1.0, "my_rewards.exact_answer", None), ("format", 0.2, "my_rewards.format", None),
        ("judge", 1.0, None, "/m/rm")]
    assert specs[1].kwargs == {"pattern": "^<a>", "options": {"x": [1, 2]}}
    assert (task.num_generations, task.loss_type, task.scale_rewards) == (4, GRPOLoss.dr_grpo, ScaleRewards.none)


@pytest.mark.parametrize(("override", "sentence"), [
    ("task.num_generations=1", "task.num_generations must be at least 2"),
    ("task.max_completion_length=512", "below task.block_size (512"),
    ("task.top_p=0", "task.top_p must be in (0, 1]"),
    ("task.epsilon=1.5", "task.epsilon must be in (0, 1)"),
    ("task.beta=-0.1", "task.beta must be 0"),
    ("task.reference=precomputed", "cannot be precomputed"),
    ("task.packing=true", "task.packing=false"),
    ("task.overlong=truncate", "never cuts a prompt"),
    ("task.rewards=[]", "needs at least one reward"),
    ("task.rewards=[{weight: 1}]", "task.rewards[0] names neither of _target_"),
    ("task.rewards=[{_target_: a.b, reward_model: c}]", "task.rewards[0] names both"),
    ("task.rewards=[{_target_: a.b, weight: heavy}]", "task.rewards[0].weight must be a number"),
    ("task.rewards=[{_target_: a.b}, {_target_: exact}]", "task.rewards[1]._target_ must be a dotted path"),
    ("task.rewards=[{_target_: a.b}, {_target_: c.b}]", "task.rewards[0] and task.rewards[1] are both named b"),
    ("task.rewards=[{reward_model: rm, margin: 2}]", "takes no arguments: remove margin"),
])
def test_bad_values_are_refused_in_one_sentence(compose_grpo, override, sentence):
    rewards = [] if override.startswith("task.rewards") else ["task.rewards=[{_target_: my.reward}]"]
    task = compose_grpo(*rewards, override)
    with pytest.raises(ConfigError) as refused:
        task.check()
    assert sentence in str(refused.value) and str(refused.value).count(". ") == 0


