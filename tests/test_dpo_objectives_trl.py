"""Every ``task.loss_type`` against TRL 1.16 (a test-only conformance reference): ``DPOTrainer``'s fifteen
loss types alone, MPO's weighted list, WPO's weighting and LD-DPO's α; ``CPOTrainer``'s SimPO and CPO and
``ORPOTrainer``'s ORPO (``trl.experimental``). The same tiny Llama, tokens, pairs and β on both sides:
the first batch's loss and TRL's metrics agree within 1e-5.

Our side is ``DPOTask._pairs`` itself (the path a training step takes), on the batch TRL's trainers see:
TRL's DPO collator pads the same token rows (the template learns nothing after the end of turn: see
``test_dpo_trl.py``), and the CPO/ORPO trainers are handed our rows in their own batch format. One
trainer of each kind, its loss options changed between cases: building one per case would cost seconds each.
"""

from __future__ import annotations

import copy

import pytest
import torch

from app.tasks.dpo.config import LossType
from app.tasks.dpo.task import DPOTask
from tests.helpers.dpo_pairs import dpo_task_with, pair_batch, preference_rows, tiny_model
from tests.helpers.tiny_chat import make_tokenizer
from tests.test_dpo_trl import BETA, METRICS, TIGHT_CHATML

trl = pytest.importorskip("trl", reason="trl (the test-only conformance reference of task=dpo) is not installed")

SMOOTHING = {LossType.robust: 0.1, LossType.exo_pair: 1e-3, LossType.aot: 0.1, LossType.aot_unpaired: 0.1}
DPO_FAMILY = [kind for kind in LossType if kind not in (LossType.simpo, LossType.cpo, LossType.orpo)]
ROWS = 6


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(TIGHT_CHATML)


@pytest.fixture(scope="module")
def models(tokenizer):
    """The reference and a policy moved away from it (so that no loss sits at its trivial value)."""
    reference = tiny_model(tokenizer, seed=0)
    policy = tiny_model(tokenizer, seed=0)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return policy.train(), reference.eval()


@pytest.fixture(scope="module")
def pairs(tokenizer) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Rows whose answers differ in length (LD-DPO's tails, IPO's averages), and our batch of them."""
    rows = preference_rows(ROWS, seed=21)
    for k, row in enumerate(rows):
        if k % 2:
            row["chosen"] = [{"role": "assistant", "content": row["chosen"][0]["content"] + " indeed , twice ."}]
    return rows, pair_batch(tokenizer, rows)


def our_task(tokenizer, reference, **options) -> DPOTask:
    return dpo_task_with(tokenizer, reference, beta=BETA, **options)


def ours(task: DPOTask, policy, batch) -> tuple[float, dict[str, float]]:
    with torch.no_grad():
        losses, metrics = task._pairs(policy, batch)
    return losses.mean().item(), {name: values.mean().item() for name, values in metrics.items()}


def agree(mine: tuple[float, dict[str, float]], loss: float, metrics: dict[str, float], names) -> None:
    assert abs(mine[0] - loss) < 1e-5 * max(1.0, abs(loss)), (mine[0], loss)
    for name in names:
        assert abs(mine[1][name] - metrics[name]) < 1e-5 * max(1.0, abs(metrics[name])), (name, mine[1][name],
                                                                                           metrics[name])


@pytest.fixture(scope="module")
def dpo_trainer(tmp_path_factory, tokenizer, models, pairs):
    """One ``DPOTrainer`` (built with WPO's extra output, turned off where a case does not ask for it)."""
    import datasets
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer

    policy, reference = models
    rows, _ = pairs
    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], per_device_train_batch_size=ROWS,
                     beta=BETA, max_length=1024, use_cpu=True, loss_type=["sigmoid"], bf16=False, use_weighting=True)
    trainer = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    trainer.model.train()
    return trainer


def trl_dpo(trainer, kinds: list[str], weights=None, smoothing=0.0, weighting=False, ld_alpha=None):
    trainer.loss_types, trainer.loss_weights = kinds, weights or [1.0] * len(kinds)
    trainer.label_smoothing, trainer.use_weighting, trainer.ld_alpha = smoothing, weighting, ld_alpha
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
    return loss, {k: trainer._metrics["train"][k][-1] for k in METRICS}


@pytest.mark.parametrize("kind", DPO_FAMILY, ids=lambda kind: kind.value)
def test_each_dpo_loss_type_agrees_with_trl(tokenizer, models, pairs, dpo_trainer, kind):
    policy, reference = models
    smoothing = SMOOTHING.get(kind, 0.0)
    task = our_task(tokenizer, reference, loss_type=kind.value, label_smoothing=smoothing)
    trl_loss, trl_metrics = trl_dpo(dpo_trainer, [kind.value], smoothing=smoothing)
    mine = ours(task, policy, pairs[1])
    agree(mine, trl_loss, trl_metrics, METRICS)


@pytest.mark.parametrize("case", ["mpo", "rpo", "wpo", "ld_dpo"])
def test_combined_losses_wpo_and_ld_dpo_agree_with_trl(tokenizer, models, pairs, dpo_trainer, case):
    """MPO (``[sigmoid, bco_pair, sft]`` weighted 0.8, 0.2, 1), RPO (``[sigmoid, sft]``), WPO's weighting
    and LD-DPO's α = 0.5 (over answers of different lengths: the tails count)."""
    policy, reference = models
    options, theirs = {
        "mpo": ({"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
                {"kinds": ["sigmoid", "bco_pair", "sft"], "weights": [0.8, 0.2, 1.0]}),
        "rpo": ({"loss_type": ["sigmoid", "sft"]}, {"kinds": ["sigmoid", "sft"]}),
        "wpo": ({"loss_type": "hinge", "use_weighting": True}, {"kinds": ["hinge"], "weighting": True}),
        "ld_dpo": ({"loss_type": "sigmoid", "ld_alpha": 0.5}, {"kinds": ["sigmoid"], "ld_alpha": 0.5}),
    }[case]
    task = our_task(tokenizer, reference, **options)
    mine = ours(task, policy, pairs[1])
    trl_loss, trl_metrics = trl_dpo(dpo_trainer, **theirs)
    agree(mine, trl_loss, trl_metrics, METRICS)
    if case == "ld_dpo":  # the weighting changed something: the plain sigmoid loss differs
        assert abs(ours(our_task(tokenizer, reference), policy, pairs[1])[0] - mine[0]) > 1e-4


def their_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our batch as CPOTrainer/ORPOTrainer's collated format (chosen_* and rejected_* tensors)."""
    pairs = len(batch["pair"])
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    out = {}
    for side, rows in (("chosen", slice(0, pairs)), ("rejected", slice(pairs, 2 * pairs))):
        out[f"{side}_input_ids"] = batch["input_ids"][rows]
        out[f"{side}_attention_mask"] = mask[rows]
        out[f"{side}_labels"] = batch["labels"][rows]
    return out


@pytest.mark.parametrize("kind", [LossType.simpo, LossType.cpo, LossType.orpo], ids=lambda kind: kind.value)
def test_the_reference_free_objectives_agree_with_trl(tmp_path, tokenizer, models, pairs, kind):
    """SimPO and CPO (``CPOTrainer``: loss_type simpo with cpo_alpha 0, sigmoid with cpo_alpha 1) and ORPO
    (``ORPOTrainer``): TRL's loss and metrics, ``nll_loss`` included (ORPO: ``log_odds_ratio``,
    ``log_odds_chosen``); none of them loads a reference."""
    import datasets
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    policy, _ = models
    text = datasets.Dataset.from_list(preference_rows(2, form="text"))
    common = {"output_dir": str(tmp_path / "trl"), "report_to": [], "beta": BETA, "use_cpu": True, "bf16": False,
              "max_length": 1024}
    if kind is LossType.orpo:
        trainer = ORPOTrainer(model=copy.deepcopy(policy), args=ORPOConfig(**common), train_dataset=text,
                              processing_class=tokenizer)
        names = (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
    else:
        trl_options = {"loss_type": "simpo", "cpo_alpha": 0.0} if kind is LossType.simpo else {"loss_type": "sigmoid"}
        trainer = CPOTrainer(model=copy.deepcopy(policy), args=CPOConfig(**common, **trl_options), train_dataset=text,
                             processing_class=tokenizer)
        names = (*METRICS, "nll_loss")
    trainer.model.train()
    with torch.no_grad():
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, their_rows(pairs[1]))
    task = our_task(tokenizer, None, loss_type=kind.value)
    assert task.reference is None and task.reference_free
    agree(ours(task, policy, pairs[1]), float(loss), {k: float(v) for k, v in metrics.items()}, names)
