"""``task=dpo task.packing=true``: whole pairs packed into rows change nothing but speed. Each pair's
summed answer log-probabilities, loss and TRL's metrics from a packed batch equal those of the same pairs
one side per row (SDPA and eager attention), and a 2-D attention mask, which would let a sequence see
the one packed before it, is caught by the same comparison. A packed run trains, evaluates and exports
through ``python -m app`` on 2 processes with the precomputed reference, its first step's loss ln 2 (the
policy starts as its reference)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from app.tasks.dpo.config import Reference
from app.tasks.dpo.packing import PackedPairs
from tests.conftest import run_app
from tests.helpers.dpo_pairs import preference_rows
from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl
from tests.test_dpo import dpo_task


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    return make_tiny_chat_llama(tmp_path_factory.mktemp("dpo_packing") / "base")


def with_attention(model: torch.nn.Module, attention: str) -> torch.nn.Module:
    model.config._attn_implementation = attention
    return model


OBJECTIVES = {"dpo": {}, "ld_wpo_rpo": {"ld_alpha": 0.5, "use_weighting": True, "loss_type": ["sigmoid", "sft"]},
              "orpo": {"loss_type": "orpo"}}


@pytest.mark.parametrize(("attention", "objective"), [("sdpa", "dpo"), ("eager", "dpo"), ("sdpa", "ld_wpo_rpo"),
                                                      ("sdpa", "orpo")])
def test_packed_pairs_give_the_unpacked_losses_and_metrics(tmp_path, chat_llama, attention, objective):
    """Also with what reads more than the summed log-probabilities: LD-DPO's per-token weights (each
    answer token's rank within its own sequence), WPO's aligned means, the answers' NLL term, and ORPO's
    whole-sequence NLL (its tokens counted within each packed sequence)."""
    rows = preference_rows(14, seed=8)
    options = OBJECTIVES[objective]
    plain, plain_data, _ = dpo_task(tmp_path / "plain", chat_llama, rows, beta=0.5, **options)
    packed, packed_data, _ = dpo_task(tmp_path / "packed", chat_llama, rows, beta=0.5, packing=True, **options)
    assert isinstance(packed_data.train, PackedPairs) and len(packed_data.train) < len(plain_data.train)
    model = with_attention(plain.build_model(), attention)  # the frozen copy: the starting weights
    packed.reference = plain.reference
    with torch.no_grad():  # the policy moves away from its reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    batch = packed_data.collate_fn([packed_data.train[i] for i in range(len(packed_data.train))])
    order = batch["pair"].tolist()
    assert sorted(order) == sorted(plain_data.train["pair"]) and "attention_mask" not in batch
    by_number = {n: i for i, n in enumerate(plain_data.train["pair"])}
    apart = plain_data.collate_fn([plain_data.train[by_number[n]] for n in order])  # the same pairs, one per row
    with torch.no_grad():
        found, apart_found = packed._sequences(model, batch), plain._sequences(model, apart)
        (logps, lengths), (logps_apart, lengths_apart) = (found.logps, found.lengths), (apart_found.logps,
                                                                                       apart_found.lengths)
        assert torch.equal(lengths, lengths_apart)
        # float32 sums of ~70 token log-probabilities, added in another order: equal to a unit or two in the
        # last place (7.6e-6 there); what is computed from them is held to that rounding
        assert torch.allclose(logps, logps_apart, atol=0, rtol=1e-6)
        rounding = 2e-6 * logps_apart.abs().max().item()
        losses, metrics = packed._pairs(model, batch)
        losses_apart, metrics_apart = plain._pairs(model, apart)
        assert torch.allclose(losses, losses_apart, atol=rounding, rtol=0)
        for name in metrics:
            assert torch.allclose(metrics[name], metrics_apart[name], atol=rounding, rtol=0), name
        sums = packed.evaluation_sums(model, batch)  # per row: the engine's samples
        assert sums["pairs"].tolist() == [len(packed_data.train[i]) for i in range(len(batch["input_ids"]))]
        assert abs(sums["loss"].sum() - losses_apart.sum()) < len(order) * rounding
        out = packed.step(model, batch)
        if packed.reads_step_totals:  # the step's totals (pairs, NLL tokens) count what the unpacked batch counts
            for name, values in packed.step_sums(model, batch).items():
                assert int(values.sum()) == int(plain.step_sums(model, apart)[name].sum()), name
        assert abs(out.mean_loss() - losses_apart.mean()) < rounding
        # a 2-D mask (even all ones) turns the packed-sequence attention off: a sequence sees the one before
        seen = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     attention_mask=torch.ones_like(batch["input_ids"])).logits
    from app.tasks.dpo.logps import sequence_logps

    contaminated = sequence_logps(seen, batch["labels"], batch["segment"], 2 * len(order)).logps
    assert (contaminated - logps_apart).abs().max() > 1e-2


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_packed_run_on_two_processes_trains_evaluates_and_exports(tmp_path):
    make_tiny_chat_llama(tmp_path / "base", hidden=64)
    write_jsonl(tmp_path / "prefs.jsonl", preference_rows(48))
    run = tmp_path / "run"
    run_app("task=dpo", f"task.config={tmp_path / 'base'}", f"task.data_files.train={tmp_path / 'prefs.jsonl'}",
            "task.block_size=128", "task.packing=true", f"task.reference={Reference.precomputed.value}",
            f"task.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=4", "trainer.batch_size=2",
            "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=4", "optim.lr=1e-3", "hardware=multi_cpu",
            "hardware.num_processes=2", "logging.trackers=[]",
            "logging.progress_bar=false", "logging.print_config=false", f"hydra.run.dir={run}",
            cwd=tmp_path, check=True, timeout=300)
    log = (run / "app.log").read_text()
    assert "packed: 43 training pairs into" in log and "rows of 256 tokens" in log
    # The data line says the held-out pairs, and the counts are pairs, not packed rows (issue 51).
    assert "data: train: 48 pairs of " in log and "; evaluation: 5 of them held out (task.eval_fraction=0.1, " \
        "task.split_seed=0);" in log
    card = (run / "model" / "README.md").read_text()
    assert re.search(r"\| train \| 43 \(in \d+ packed rows\) \|", card) and re.search(
        r"\| evaluation \| 5 \(in \d+ packed rows\) \|", card), card
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in metrics if "train/loss" in r)
    assert first["step"] == 1 and abs(first["train/loss"] - math.log(2)) < 1e-6
    last = [r for r in metrics if "eval/loss" in r][-1]
    assert {"eval/rewards/accuracies", "eval/logps/chosen"} <= set(last) and math.isfinite(last["eval/loss"])
    assert last["eval/num_samples"] == 5  # the pairs the evaluation rows hold
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run / "model").config.vocab_size > 0
