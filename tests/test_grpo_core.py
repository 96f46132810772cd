"""``task=grpo``'s pure parts, before the task: its schema (composed through Hydra, rewards as a list of
free-form entries; bad values refused in one sentence); the advantages and reward metrics and, for each loss
type with and without the KL term, the loss, its gradient and its metrics against TRL 1.16's own
``GRPOTrainer`` code (``tests/helpers/trl_grpo.py``)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from app.config import ConfigError
from app.tasks.grpo.advantages import (
    RewardError,
    group_advantages,
    reward_column,
    reward_metrics,
    reward_table,
    summed_rewards,
)
from app.tasks.grpo.config import GRPOConfig, GRPOLoss, ScaleRewards
from app.tasks.grpo.loss import Objective, grpo_loss
from tests.conftest import CONF_DIR
from tests.helpers.trl_grpo import trl_loss, trl_scores

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                               reason="trl (the test-only conformance reference of task=grpo) is not installed")




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


# -- rewards and advantages ------------------------------------------------------------------------------------

COMPLETIONS = [[3, 7, 0], [5, 0], [7, 7, 7, 0], [1], [2, 2], [7], [9, 9, 9], [4, 0], [6], [6], [6], [6]]
"""Three prompts' groups of 4: the third group's rewards are all equal (zero std)."""


def length(completions, completion_ids, **columns):
    return [None if i == 4 else float(len(ids)) if i < 8 else 1.0 for i, ids in enumerate(completion_ids)]


def sevens(completions, completion_ids, **columns):
    return [None if i in (0, 4, 9) else float(ids.count(7)) if i < 8 else 0.0 for i, ids in enumerate(completion_ids)]


@needs_trl
@pytest.mark.parametrize("scale", list(ScaleRewards))
def test_advantages_and_reward_metrics_equal_trl(scale):
    """Completion 4 is unscored (every function returned None): TRL leaves it out of its group's
    baseline and of the statistics, and gives it advantage 0; so do we."""
    weights = [1.0, 0.5]
    table = reward_table([reward_column(f.__name__, f(None, COMPLETIONS), len(COMPLETIONS)) for f in (length, sevens)])
    scored = group_advantages(summed_rewards(table, torch.tensor(weights)), 4, scale)
    theirs, their_metrics = trl_scores(COMPLETIONS, [length, sevens], weights, 4, scale)
    torch.testing.assert_close(scored.advantages, theirs, atol=1e-6, rtol=0)
    assert scored.advantages[4] == 0 and math.isnan(scored.rewards[4])
    ours = reward_metrics(table, ["length", "sevens"], scored)
    assert ours.keys() == their_metrics.keys()
    for name, value in ours.items():
        assert value == pytest.approx(their_metrics[name], abs=1e-6), name
    if scale is ScaleRewards.group:
        assert ours["frac_reward_zero_std"] == pytest.approx(4 / 12)  # the third group


@pytest.mark.parametrize(("values", "sentence"), [
    (0.5, "returned float, not a list of 3 numbers"),
    ([1.0, 2.0], "returned 2 values for 3 completions"),
    ([1.0, "yes", None], "returned 'yes' for completion 1"),
    ([1.0, float("nan"), None], "returned nan for completion 1"),
])
def test_a_reward_output_that_cannot_be_used_is_refused(values, sentence):
    with pytest.raises(RewardError, match=sentence.replace("(", r"\(")):
        reward_column("exact", values, 3)
    assert reward_column("exact", [True, 2, None], 3)[:2] == [1.0, 2.0]


# -- the loss against TRL --------------------------------------------------------------------------------------

ROWS, LENGTH, MICRO_BATCHES = 12, 7, 2


def loss_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """A generation batch of 12 completions (4 prompts × 3) of 0 to 7 tokens: the policy's, the
    generation-time (ratios up to ±35 %: both clips act) and the reference's log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 0, 2, 7, 4, 7, 5, 3])
    mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    logps = -torch.rand(ROWS, LENGTH, generator=g) * 3
    return {"logps": logps, "old": logps + (torch.rand(ROWS, LENGTH, generator=g) - 0.5) * 0.6,
            "ref": logps + (torch.rand(ROWS, LENGTH, generator=g) - 0.5), "mask": mask,
            "advantages": torch.randn(ROWS, generator=g), "entropies": torch.rand(ROWS, LENGTH, generator=g) * 4}


def step_loss(data: dict[str, torch.Tensor], logps: torch.Tensor, objective: Objective, splits: int):
    """Our loss of the optimizer step as the engine trains on it: per-completion sums and items over
    ``splits`` micro-batches, the sum divided by the items."""
    total, items = 0.0, 0.0
    for rows in torch.arange(ROWS).chunk(splits):
        out = grpo_loss(logps[rows], data["advantages"][rows], data["mask"][rows], objective, data["old"][rows],
                        data["ref"][rows], data["entropies"][rows])
        total, items = total + out.sample_losses.sum(), items + out.sample_items.sum()
    return total / items


@needs_trl
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", list(GRPOLoss))
def test_loss_gradient_and_metrics_equal_trl(loss_type, beta):
    data = loss_inputs()
    objective = Objective(loss_type, 0.2, 0.28, beta, LENGTH)
    ours_logps = data["logps"].clone().requires_grad_()
    ours = step_loss(data, ours_logps, objective, MICRO_BATCHES)
    ours.backward()
    theirs_logps = data["logps"].clone().requires_grad_()
    theirs, their_metrics = 0.0, {}
    for rows in torch.arange(ROWS).chunk(MICRO_BATCHES):
        inputs = {"completion_mask": data["mask"][rows], "advantages": data["advantages"][rows],
                  "old_per_token_logps": data["old"][rows], "num_items_in_batch": data["mask"].sum(),
                  **({"ref_per_token_logps": data["ref"][rows]} if beta else {})}
        loss, their_metrics = trl_loss(theirs_logps[rows], inputs, loss_type, 0.2, 0.28, beta, LENGTH, MICRO_BATCHES,
                                       data["entropies"][rows])
        theirs = theirs + loss
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    torch.testing.assert_close(ours_logps.grad, theirs_logps.grad, atol=1e-6, rtol=0)
    # the metrics of the last micro-batch, as TRL logs them
    rows = torch.arange(ROWS).chunk(MICRO_BATCHES)[-1]
    out = grpo_loss(data["logps"][rows], data["advantages"][rows], data["mask"][rows], objective, data["old"][rows],
                    data["ref"][rows], data["entropies"][rows])
    ours_metrics = {name: (sums.sum() / out.tokens.sum()).item() for name, sums in out.token_sums.items()}
    ours_metrics["clip_ratio/low_min"] = out.sequence_clip["clip_ratio/low_min"].nan_to_num(torch.inf).min().item()
    ours_metrics["clip_ratio/high_max"] = out.sequence_clip["clip_ratio/high_max"].nan_to_num(-torch.inf).max().item()
    assert ours_metrics.keys() == their_metrics.keys()
    for name, value in ours_metrics.items():
        assert value == pytest.approx(their_metrics[name], abs=1e-6), name
    assert 0 < ours_metrics["clip_ratio/region_mean"] < 1  # the clip acts on this batch


@pytest.mark.parametrize("loss_type", [GRPOLoss.dapo, GRPOLoss.grpo, GRPOLoss.dr_grpo])
def test_the_step_loss_does_not_depend_on_the_split(loss_type):
    data = loss_inputs(seed=1)
    objective = Objective(loss_type, 0.2, 0.2, 0.04, LENGTH)
    whole = step_loss(data, data["logps"], objective, 1)
    for splits in (2, 3, 4, 12):
        assert step_loss(data, data["logps"], objective, splits).item() == pytest.approx(whole.item(), abs=1e-6)


