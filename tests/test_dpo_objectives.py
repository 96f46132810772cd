"""``task.loss_type``'s table of objectives without TRL: at policy = reference every objective takes its
closed form (hinge 1, robust and sigmoid_norm ln 2, bco_pair and nca_pair 2 ln 2, apo_zero and apo_down 1,
sppo_hard 1/(2β²)...); the table and the names agree; what the schema refuses; and the NLL term's token
count, which the engine totals over the optimizer step, is the one the loss divides by."""

from __future__ import annotations

import math

import pytest
import torch

from app.config import ConfigError
from app.tasks.dpo.config import BATCH_DEPENDENT, REFERENCE_FREE, SMOOTHED, DPOConfig, LossType
from app.tasks.dpo.objectives import OBJECTIVES
from tests.helpers.dpo_pairs import dpo_task_with, pair_batch, preference_rows, tiny_model
from tests.helpers.tiny_chat import make_tiny_chat_llama, make_tokenizer

BETA = 0.25
LN2 = math.log(2)
AT_THE_REFERENCE = {
    LossType.sigmoid: LN2, LossType.hinge: 1.0, LossType.ipo: (1 / (2 * BETA)) ** 2, LossType.robust: LN2,
    LossType.sigmoid_norm: LN2, LossType.bco_pair: 2 * LN2, LossType.nca_pair: 2 * LN2, LossType.apo_zero: 1.0,
    LossType.apo_down: 1.0, LossType.sppo_hard: 1 / (2 * BETA ** 2), LossType.aot: LN2, LossType.aot_unpaired: LN2,
    LossType.discopop: (LN2 + 1) / 2, LossType.exo_pair: -LN2 - 0.5 * math.log(1e-3) - 0.5 * math.log1p(-1e-3),
}
SMOOTHING = {LossType.robust: 0.2, LossType.exo_pair: 1e-3, LossType.aot: 0.2}


@pytest.fixture(scope="module")
def setup():
    tokenizer = make_tokenizer()
    model = tiny_model(tokenizer, seed=3).train()
    return tokenizer, model, pair_batch(tokenizer, preference_rows(5, seed=4))


def test_the_table_holds_every_loss_type_and_the_sets_name_known_ones():
    assert set(OBJECTIVES) == set(LossType)
    assert REFERENCE_FREE | SMOOTHED | BATCH_DEPENDENT <= set(LossType)
    assert BATCH_DEPENDENT == {LossType.aot, LossType.aot_unpaired}


@pytest.mark.parametrize("kind", list(AT_THE_REFERENCE), ids=lambda kind: kind.value)
def test_at_policy_equal_reference_each_loss_takes_its_closed_form(setup, kind):
    """The policy is its own reference (a frozen copy of it): every ratio is 0, so every pair's loss is
    the formula's value at 0, whatever the pairs; the rewards are 0."""
    tokenizer, model, batch = setup
    task = dpo_task_with(tokenizer, model, beta=BETA, loss_type=kind.value, label_smoothing=SMOOTHING.get(kind, 0.0))
    with torch.no_grad():
        losses, metrics = task._pairs(model, batch)
    assert losses.tolist() == pytest.approx([AT_THE_REFERENCE[kind]] * 5, abs=1e-5)
    assert metrics["rewards/margins"].abs().max() < 1e-5 and metrics["rewards/accuracies"].sum() == 0


def test_the_sft_term_is_the_mean_over_the_chosen_tokens_of_the_step_or_of_the_batch(setup):
    """``[sigmoid, sft]`` at the reference: the sigmoid's ln 2 plus the NLL term, whose mean over the pairs
    is the NLL per chosen answer token; with the optimizer step's totals (``begin_step``) it is scaled by
    the step's pairs over its tokens instead of the batch's."""
    tokenizer, model, batch = setup
    task = dpo_task_with(tokenizer, model, beta=BETA, loss_type=["sigmoid", "sft"])
    assert task.reads_step_totals
    with torch.no_grad():
        losses, _ = task._pairs(model, batch)
        found = task._sequences(model, batch)
    chosen_tokens = found.lengths[:5].sum()
    per_token = -found.plain[:5].sum() / chosen_tokens
    assert float(losses.mean()) == pytest.approx(LN2 + float(per_token), abs=1e-5)
    sums = task.step_sums(model, batch)
    assert sums["pairs"].tolist() == [1] * 5 and int(sums["nll_tokens"].sum()) == int(chosen_tokens)
    task.begin_step({"pairs": torch.tensor(10.0), "nll_tokens": 3 * chosen_tokens.float()})  # a step of other batches
    with torch.no_grad():
        scaled, _ = task._pairs(model, batch)
    expected = LN2 + float(-found.plain[:5].sum() * (10 / (3 * chosen_tokens)) / 5)
    assert float(scaled.mean()) == pytest.approx(expected, abs=1e-5)
    model.eval()
    with torch.no_grad():  # evaluation: the batch's own count again
        assert float(task._pairs(model, batch)[0].mean()) == pytest.approx(float(losses.mean()), abs=1e-6)
    model.train()


def test_orpo_counts_the_whole_chosen_sequences_as_its_loss_does(setup):
    tokenizer, model, batch = setup
    task = dpo_task_with(tokenizer, None, beta=BETA, loss_type="orpo")
    found = task._sequences(model, batch)
    assert found.whole_lengths is not None and found.whole is not None
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))[:5].sum(dim=1) - 1
    assert found.whole_lengths[:5].tolist() == real.tolist()
    assert task.step_sums(model, batch)["nll_tokens"].tolist() == real.tolist()
    assert (found.whole[:5] < found.plain[:5]).all()  # the prompt's tokens too


@pytest.mark.parametrize(("options", "why"), [
    ({"loss_type": "hinj"}, "task.loss_type has hinj, which is not one of sigmoid, hinge"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "task.loss_weights has 1 weight"),
    ({"loss_type": ["orpo", "sft"]}, "reference-free and stands alone"),
    ({"loss_type": "hinge", "label_smoothing": 0.1}, "task.label_smoothing applies to"),
    ({"loss_type": "exo_pair"}, "needs task.label_smoothing above 0"),
    ({"loss_type": "aot", "use_weighting": True}, "cannot be used together"),
    ({"loss_type": "simpo", "reference": "precomputed"}, "is reference-free: leave task.reference"),
    ({"loss_type": "sigmoid", "cpo_alpha": 1.0}, "task.cpo_alpha is the NLL weight"),
    ({"reference": "no/such/folder"}, "task.reference=no/such/folder is none of copy, base and precomputed"),
    ({"sync_ref_every": 4, "reference": "base"}, "task.reference=base has none to move"),
    ({"ld_alpha": 1.5}, "task.ld_alpha must be in"),
])
def test_the_schema_refuses_what_cannot_work(options, why):
    cfg = DPOConfig(config="x", **options)
    cfg.data_files.train = "x.jsonl"
    with pytest.raises(ConfigError, match=why):
        cfg.check()


def test_a_name_or_a_list_composes_from_the_command_line():
    from tests.conftest import compose_config

    one = compose_config("task=dpo", "task.config=x", "task.data_files.train=x.jsonl", "task.loss_type=hinge").task
    many = compose_config("task=dpo", "task.config=x", "task.data_files.train=x.jsonl",
                          "task.loss_type=[sigmoid,bco_pair,sft]", "task.loss_weights=[0.8,0.2,1.0]").task
    assert one.objectives() == (LossType.hinge,)
    assert many.objectives() == (LossType.sigmoid, LossType.bco_pair, LossType.sft) and many.weights() == (0.8, 0.2, 1.0)


def test_a_reference_free_objective_loads_no_reference_and_aot_says_it_is_batch_dependent(tmp_path, caplog):
    """SimPO as a run builds it: no reference model beside the policy, no reference pass, said at the
    start, a step all the same; AOT says at the start that its loss depends on the batch's split."""
    from tests.test_dpo import dpo_task

    model = make_tiny_chat_llama(tmp_path / "model")
    with caplog.at_level("INFO"):
        task, data, runtime = dpo_task(tmp_path / "run", model, preference_rows(8), loss_type="simpo",
                                       reference="copy")
        policy = task.build_model().train()
        dpo_task(tmp_path / "aot", model, preference_rows(8), loss_type="aot")
    assert "no reference model: the objective reads the policy's log-probabilities alone" in caplog.text
    assert ("task.loss_type=aot compares the pairs of each micro-batch with each other (it sorts their margins): "
            "its loss depends on how the optimizer step's batch is split, by definition") in caplog.text
    assert task.reference is None and runtime.registered == []
    out = task.step(policy, data.collate_fn([data.train[i] for i in range(3)]))
    assert out.sample_losses.shape == (3,) and torch.isfinite(out.sample_losses).all()
