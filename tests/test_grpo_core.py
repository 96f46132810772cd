"""``task=grpo``'s pure parts, before the task: its schema (composed through Hydra, rewards as a list of
free-form entries; bad values refused in one sentence), the advantages and reward metrics and, for each
loss type with and without the KL term, the loss, its gradient and its metrics against TRL 1.16's own
``GRPOTrainer`` code (``tests/helpers/trl_grpo.py``); the gradient at μ = 1, β = 0 against a REINFORCE
with the group baseline computed by hand on a tiny Llama; and reproducible rollouts: the sampling
distribution is Transformers' and a row's completion does not change with the batch it is generated in."""

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
from app.tasks.grpo.loss import Objective, grpo_loss, token_logps_and_entropies
from app.tasks.grpo.sampling import (
    Sampling,
    generate,
    processed_scores,
    row_keys,
    row_uniforms,
    sample_tokens,
)
from tests.conftest import CONF_DIR
from tests.helpers.trl_grpo import trl_loss, trl_scores

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                               reason="trl (the test-only conformance reference of task=grpo) is not installed")



@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny models' ops are too small to gain from more, and on a busy machine a
    second thread's waits cost several times the work (a generation test: 2.5 s against 20 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the schema ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_grpo():
    """Compose the app's real config with ``task=grpo`` (conf/task/grpo.yaml over GRPOConfig)."""
    from hydra import compose, initialize_config_dir

    from app.cli.configure import register_configs, to_run_config

    register_configs()
    base = ["task=grpo", "task.model=m", "task.data_files.train=prompts.jsonl"]

    def composed(*overrides: str):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return to_run_config(compose(config_name="config", overrides=[*base, *overrides])).task

    return composed


def test_a_reward_entry_takes_a_key_it_lacked_without_a_plus(compose_grpo):
    """task.rewards is a list of free-form entries: an entry's key it lacks is set as a dict field's would be
    (app/cli/configure.py opens the list's entries as it opens dict fields)."""
    task = compose_grpo("task.rewards=[{_target_: my.reward}]", "task.rewards.0.weight=0.5", "task.rewards.0.bonus=2")
    assert task.reward_specs()[0].weight == 0.5 and task.reward_specs()[0].kwargs == {"bonus": 2}


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
    ("task.max_completion_length=1024", "below task.block_size (1024"),
    ("task.top_p=0", "task.top_p must be in (0, 1]"),
    ("task.epsilon=1.5", "task.epsilon must be in (0, 1)"),
    ("task.beta=-0.1", "task.beta must be 0"),
    ("task.reference=precomputed", "cannot be precomputed"),
    ("task.packing=true", "task.packing=false"),
    ("task.streaming=true", "task.streaming=true does not apply to task=grpo: it reads its prompts whole"),
    ("task.train_on=all", "task.train_on=all does not apply to task=grpo: it reads prompts"),
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


# -- the gradient on a tiny model: REINFORCE with the group baseline -----------------------------------------------

VOCAB, GROUP = 96, 4


def tiny_llama(seed: int = 0, attention: str = "eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation=attention)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def rollout_batch():
    """Two prompts' groups of 4 completions generated by the tiny model, as one right-padded batch."""
    model = tiny_llama()
    prompts = [[5, 9, 12], [7, 3]]
    rows = [p for p in prompts for _ in range(GROUP)]
    keys = row_keys(0, 0, [i // GROUP for i in range(len(rows))], [i % GROUP for i in range(len(rows))])
    rollout = generate(model, rows, keys, Sampling(), 6, stop_ids=list(range(0, VOCAB, 3)), pad_id=1)
    return model, prompts, rollout


def completion_logps(model, prompts, rollout) -> torch.Tensor:
    """Each completion token's log-probability under ``model`` (prompts unpadded, one forward per row)."""
    rows = []
    for i in range(rollout.completion_ids.shape[0]):
        prompt = torch.tensor(prompts[i // GROUP])
        ids = torch.cat([prompt, rollout.completion_ids[i]])[None]
        logits = model(input_ids=ids, use_cache=False).logits[:, len(prompt) - 1:-1]
        rows.append(token_logps_and_entropies(logits, rollout.completion_ids[i][None])[0][0])
    return torch.stack(rows)


@pytest.mark.parametrize("loss_type", [GRPOLoss.grpo, GRPOLoss.dapo, GRPOLoss.dr_grpo])
def test_the_gradient_is_reinforce_with_the_group_baseline(rollout_batch, loss_type):
    model, prompts, rollout = rollout_batch
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5, 3.0, 1.0, 1.0, 0.0])
    advantages = rewards - rewards.view(-1, GROUP).mean(dim=1).repeat_interleave(GROUP)
    mask = rollout.completion_mask.float()
    assert len(set(mask.sum(dim=1).tolist())) > 1  # completions of several lengths
    max_length = 10
    out = grpo_loss(completion_logps(model, prompts, rollout), advantages, mask,
                    Objective(loss_type, 0.2, 0.2, 0.0, max_length))
    model.zero_grad()
    (out.sample_losses.sum() / out.sample_items.sum()).backward()
    ours = [p.grad.clone() for p in model.parameters()]
    weights = {GRPOLoss.grpo: 1 / (len(rewards) * mask.sum(dim=1)), GRPOLoss.dapo: 1 / mask.sum().expand(len(rewards)),
               GRPOLoss.dr_grpo: torch.full((len(rewards),), 1 / (len(rewards) * max_length))}[loss_type]
    model.zero_grad()
    logps = completion_logps(model, prompts, rollout)
    (-(weights * advantages)[:, None] * logps * mask).sum().backward()
    for mine, hand in zip(ours, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(mine, hand, atol=1e-6, rtol=0)


def test_groups_with_equal_rewards_give_no_gradient(rollout_batch):
    model, prompts, rollout = rollout_batch
    scored = group_advantages(torch.tensor([1.0] * GROUP + [0.0] * GROUP), GROUP, ScaleRewards.group)
    assert torch.equal(scored.advantages, torch.zeros(2 * GROUP)) and bool(scored.zero_std.all())
    out = grpo_loss(completion_logps(model, prompts, rollout), scored.advantages, rollout.completion_mask,
                    Objective(GRPOLoss.dapo, 0.2, 0.2, 0.0, 10))
    model.zero_grad()
    (out.sample_losses.sum() / out.sample_items.sum()).backward()
    assert all(not p.grad.any() for p in model.parameters())


# -- sampling --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 5, 0.9), (1.3, 0, 0.5), (1.0, 3, 1.0)])
def test_processed_scores_are_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    logits[0, :10] = 2.0  # ties at the top-k boundary
    theirs = TemperatureLogitsWarper(temperature)(None, logits) if temperature != 1.0 else logits
    theirs = TopKLogitsWarper(top_k)(None, theirs) if top_k > 0 else theirs
    theirs = TopPLogitsWarper(top_p)(None, theirs) if top_p < 1.0 else theirs
    assert torch.equal(processed_scores(logits, Sampling(temperature, top_k, top_p)), theirs)


def test_the_sampled_tokens_follow_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    sampling = Sampling(temperature=0.8, top_k=5, top_p=0.95)
    draws = 40000
    keys = row_keys(11, 2, range(draws), [0] * draws)
    tokens = sample_tokens(logits.expand(draws, -1), keys, torch.full((draws,), 3), sampling)
    expected = processed_scores(logits, sampling).softmax(dim=-1)[0]
    observed = torch.bincount(tokens, minlength=6).double() / draws
    assert observed[expected == 0].sum() == 0
    # 5 standard deviations of a binomial share
    assert ((observed - expected).abs() <= 5 * (expected * (1 - expected) / draws).sqrt() + 1e-9).all(), observed


def test_the_random_number_is_a_function_of_the_row_key_and_position_only():
    keys = row_keys(0, 5, [3, 8, 3], [1, 1, 2])
    drawn = row_uniforms(keys, torch.tensor([4, 4, 4]))
    assert drawn[1] == row_uniforms(keys[1:2], torch.tensor([4]))[0]
    assert drawn[0] != drawn[2]  # another completion of the same prompt
    assert drawn[0] != row_uniforms(keys[:1], torch.tensor([5]))[0]  # another position
    many = row_uniforms(row_keys(1, 0, range(20000), [0] * 20000), torch.arange(20000))
    assert 0 < many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 0.01
    assert torch.histc(many, bins=10, min=0, max=1).sub(2000).abs().max() < 5 * 2000 ** 0.5  # uniform by tenths
    assert len(torch.unique(many)) == len(many)  # 53 bits: no two alike


PROMPTS = [[4, 8, 15], [16, 23, 42, 7, 9, 11, 2], [5], [30, 31, 32, 33, 34]]


def completions_by_row(model, prompt_order: list[int], sampling: Sampling,
                       **shapes) -> dict[tuple[int, int], list[int]]:
    """Generate ``GROUP`` completions for each prompt in ``prompt_order`` (global indices) in one batch."""
    rows = [(p, k) for p in prompt_order for k in range(GROUP)]
    keys = row_keys(7, 3, [p for p, _ in rows], [k for _, k in rows])
    rollout = generate(model, [PROMPTS[p] for p, _ in rows], keys, sampling, 24, stop_ids=[0, 1, 2], pad_id=3, **shapes)
    return {row: rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist() for i, row in enumerate(rows)}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_completion_does_not_depend_on_the_batch_it_is_generated_in(attention):
    model = tiny_llama(1, attention)
    sampling = Sampling(temperature=1.2, top_k=40, top_p=0.95)
    whole = completions_by_row(model, [0, 1, 2, 3], sampling)
    halves = {**completions_by_row(model, [0, 1], sampling), **completions_by_row(model, [2, 3], sampling)}
    reversed_order = completions_by_row(model, [3, 2, 1, 0], sampling)
    alone = {row: c for p in range(4) for row, c in completions_by_row(model, [p], sampling).items()}
    assert whole == halves == reversed_order == alone
    assert sum(len(c) for c in whole.values()) > 150  # many tokens compared
    assert len({tuple(c) for c in whole.values()}) > 12  # the completions of a prompt differ


def test_at_a_fixed_shape_the_logits_are_bitwise_equal_in_any_composition():
    """Eager attention, every prompt left-padded to 8 tokens, 16 rows a batch: a row's logits are the
    same bits alone, in halves and in reverse order (at the natural shapes they differ in the last bits)."""
    model = tiny_llama(1, "eager")
    captured: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, args, output: captured.append(output.logits[:, -1].clone()))
    try:
        def logits_by_row(order: list[int], **shapes) -> dict[tuple[int, int], torch.Tensor]:
            captured.clear()
            rows = [(p, k) for p in order for k in range(GROUP)]
            keys = row_keys(7, 3, [p for p, _ in rows], [k for _, k in rows])
            generate(model, [PROMPTS[p] for p, _ in rows], keys, Sampling(), 12, stop_ids=[], pad_id=3, **shapes)
            # At natural shapes a prompt's GROUP rows are prefilled as one (the first step has a row per prompt).
            first = [order.index(p) if not shapes else i for i, (p, _) in enumerate(rows)]
            return {row: torch.stack([captured[0][first[i]], *(step[i] for step in captured[1:])])
                    for i, row in enumerate(rows)}

        fixed = {"pad_to": 8, "rows_to": 16}
        whole = logits_by_row([0, 1, 2, 3], **fixed)
        for order in ([0, 1], [2, 3], [3, 2, 1, 0], [2]):
            for row, logits in logits_by_row(order, **fixed).items():
                assert torch.equal(logits, whole[row]), row
        natural = {**logits_by_row([0, 1]), **logits_by_row([2, 3])}
        differences = torch.stack([(natural[row] - whole[row]).abs().max() for row in whole])
        assert differences.max() < 1e-5  # the same logits up to the last bits
    finally:
        hook.remove()


def test_generation_stops_at_a_stop_token_or_the_length():
    model = tiny_llama(2)
    stops = list(range(0, VOCAB, 4))  # a quarter of the vocabulary: most rows stop within 5 tokens
    rows = [PROMPTS[i % 4] for i in range(32)]
    rollout = generate(model, rows, row_keys(0, 0, range(32), [0] * 32), Sampling(), 5, stop_ids=stops, pad_id=95)
    stopped = 0
    for ids, mask, truncated in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist(),
                                    rollout.truncated.tolist(), strict=True):
        n = sum(mask)
        assert mask == [1] * n + [0] * (len(mask) - n) and ids[n:] == [95] * (len(ids) - n)
        assert not any(t in stops for t in ids[:n - 1])
        assert truncated == (ids[n - 1] not in stops) and (not truncated or n == 5)
        stopped += not truncated
    assert 0 < stopped < 32 and rollout.completion_ids.shape[1] <= 5


def test_sharing_a_prompt_and_dropping_stopped_rows_leave_every_completion_as_it_was():
    """At natural shapes a group's prompt is prefilled once and stopped rows leave the batch: the completions
    are those of every row computed to the end at a fixed shape (and far fewer rows are computed)."""
    model = tiny_llama(2)
    rows_seen: list[int] = []
    hook = model.register_forward_hook(lambda module, args, output: rows_seen.append(output.logits.shape[0]))
    stops = list(range(0, VOCAB, 8))  # an eighth of the vocabulary: the rows stop at many different steps
    rows = [(p, k) for p in range(4) for k in range(2 * GROUP)]
    keys = row_keys(5, 1, [p for p, _ in rows], [k for _, k in rows])
    prompts = [PROMPTS[p] for p, _ in rows]
    try:
        fixed = generate(model, prompts, keys, Sampling(temperature=0.9), 16, stops, pad_id=95, pad_to=8,
                         rows_to=len(rows))
        computed_fixed, rows_seen[:] = sum(rows_seen), []
        natural = generate(model, prompts, keys, Sampling(temperature=0.9), 16, stops, pad_id=95)
    finally:
        hook.remove()
    assert torch.equal(natural.completion_ids, fixed.completion_ids)
    assert torch.equal(natural.completion_mask, fixed.completion_mask) and torch.equal(natural.truncated, fixed.truncated)
    lengths = natural.completion_mask.sum(dim=1)
    assert lengths.min() < 4 and 0 < int(natural.truncated.sum()) < len(rows)  # stops early and late
    assert rows_seen[0] == 4  # one prefill row per prompt
    assert sum(rows_seen) < 0.6 * computed_fixed, (rows_seen, computed_fixed)
