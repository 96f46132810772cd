"""``task=dpo`` in process: the loss equals a hand computation (sigmoid with label smoothing, IPO), from
log-probabilities computed pair by pair without padding; the three reference modes give the same
reference values and the same first-step loss (ln 2: the policy starts as its reference); the explicit,
implicit-prompt and string forms; bad pairs refused naming file and line; the precomputed values
travel with the checkpoint state, so a resumed run does not compute them again."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from app.config import ConfigError
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.dpo.config import DPOConfig, LossType, Reference
from app.tasks.dpo.objectives import Terms, preference_losses
from app.tasks.dpo.reference import logps_forward
from app.tasks.dpo.task import DPOTask
from app.tasks.sft.config import BadRows
from tests.helpers.dpo_pairs import preference_rows
from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl


class OneProcess:
    """The runtime as a task sees it in build_data, on one process (keeps what is registered)."""

    is_main_process = True
    static_shapes = False
    num_processes, process_index = 1, 0

    def __init__(self) -> None:
        self.registered: list = []

    def main_process_first(self):
        return nullcontext()

    def register_for_checkpointing(self, *objects) -> None:
        self.registered.extend(objects)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        return tensor

    def gather_object(self, obj):
        return list(obj)

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        assert evaluation_mode and not any(p.requires_grad for p in model.parameters())
        return model.eval()  # one CPU process in full precision: placed and autocast already


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    return make_tiny_chat_llama(tmp_path_factory.mktemp("dpo") / "base")


def dpo_task(tmp_path: Path, model: Path, rows: list[dict], **options) -> tuple[DPOTask, object, OneProcess]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    train = write_jsonl(tmp_path / "prefs.jsonl", rows)
    options = {"packing": False, "block_size": 128, **options}
    cfg = DPOConfig(config=str(model), cache_dir=str(tmp_path / "cache"), **options)
    cfg.data_files.train = str(train)
    task, runtime = DPOTask(cfg), OneProcess()
    torch.manual_seed(0)
    return task, task.build_data(runtime), runtime


def hand_logp(model, ids: list[int], labels: list[int]) -> float:
    """Σ log p(token | before) over the learnt tokens of one unpadded row, in float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logps = torch.log_softmax(logits, dim=-1)
    return sum(logps[t - 1, labels[t]].item() for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX)


def test_the_losses_are_the_formulas():
    policy = torch.tensor([[-10.0, -3.5, -7.25], [-12.0, -3.0, -9.0]])
    reference = torch.tensor([[-11.0, -3.0, -7.0], [-11.5, -3.25, -8.0]])
    lengths = torch.tensor([[4, 2, 3], [5, 2, 6]])
    beta, eps = 0.3, 0.1
    nll = torch.zeros(3)
    losses, metrics = preference_losses(Terms(policy, reference, lengths, nll, beta, eps), (LossType.sigmoid,), (1.0,))
    ipo, _ = preference_losses(Terms(policy, reference, lengths, nll, beta), (LossType.ipo,), (1.0,))
    for k in range(3):
        pc, pr, rc, rr = policy[0, k].item(), policy[1, k].item(), reference[0, k].item(), reference[1, k].item()
        z = beta * ((pc - rc) - (pr - rr))
        sig = 1 / (1 + math.exp(-z))
        assert losses[k].item() == pytest.approx(-(1 - eps) * math.log(sig) - eps * math.log(1 - sig), abs=1e-6)
        h = (pc - rc) / lengths[0, k].item() - (pr - rr) / lengths[1, k].item()
        assert ipo[k].item() == pytest.approx((h - 1 / (2 * beta)) ** 2, abs=1e-5)
        assert metrics["rewards/chosen"][k].item() == pytest.approx(beta * (pc - rc))
        assert metrics["rewards/margins"][k].item() == pytest.approx(beta * ((pc - rc) - (pr - rr)))
        assert metrics["rewards/accuracies"][k].item() == float(pc - rc > pr - rr)
        assert metrics["logps/rejected"][k].item() == pr


@pytest.mark.parametrize("loss_type", [LossType.sigmoid, LossType.ipo])
def test_the_step_loss_equals_a_hand_computation_pair_by_pair(tmp_path, chat_llama, loss_type):
    rows = preference_rows(12, seed=3)
    options = {"label_smoothing": 0.2} if loss_type is LossType.sigmoid else {}
    task, data, _ = dpo_task(tmp_path, chat_llama, rows, beta=0.5, loss_type=loss_type, **options)
    model = task.build_model()  # the frozen copy is taken here: the starting weights
    with torch.no_grad():  # the policy moves away from its reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference = task.reference.model
    pairs = [data.train[i] for i in range(4)]
    out = task.step(model, data.collate_fn(pairs))
    expected = []
    for pair in pairs:
        c, r = (pair["chosen_ids"], pair["chosen_labels"]), (pair["rejected_ids"], pair["rejected_labels"])
        pc, pr, rc, rr = hand_logp(model, *c), hand_logp(model, *r), hand_logp(reference, *c), hand_logp(reference, *r)
        if loss_type is LossType.sigmoid:
            z = 0.5 * ((pc - rc) - (pr - rr))
            expected.append(-0.8 * math.log(1 / (1 + math.exp(-z))) - 0.2 * math.log(1 / (1 + math.exp(z))))
        else:
            n_c = sum(label != IGNORE_INDEX for label in c[1][1:])
            n_r = sum(label != IGNORE_INDEX for label in r[1][1:])
            expected.append(((pc - rc) / n_c - (pr - rr) / n_r - 1 / (2 * 0.5)) ** 2)
    assert out.sample_items == 1 and out.sample_losses.shape == (4,)
    assert out.sample_losses.tolist() == pytest.approx(expected, abs=1e-5)
    assert abs(out.mean_loss().item() - sum(expected) / 4) < 1e-5


def test_the_three_reference_modes_agree_and_the_first_loss_is_ln2(tmp_path, chat_llama):
    from peft import LoraConfig, get_peft_model

    rows = preference_rows(20, seed=4)
    found = {}
    for reference in (Reference.copy, Reference.base, Reference.precomputed):
        task, data, runtime = dpo_task(tmp_path / reference.value, chat_llama, rows, reference=reference)
        model = task.build_model()
        if reference is Reference.base:
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        model.train()
        batch = data.collate_fn([data.train[i] for i in range(6)])
        ref = task.reference(model, batch, logps_forward)
        out = task.step(model, batch)
        found[reference] = (ref, out.mean_loss().item())
        if reference is Reference.precomputed:
            assert runtime.registered == [task.reference] and task.reference.passes == 1
    values = [ref for ref, _ in found.values()]
    for other in values[1:]:
        assert torch.allclose(values[0], other, atol=1e-5, rtol=0)
    for _, loss in found.values():
        assert abs(loss - math.log(2)) < 1e-6


def test_precomputed_values_come_back_from_the_checkpoint_state_and_are_not_computed_again(tmp_path, chat_llama):
    from app.tasks.dpo.reference import Precomputed

    rows = preference_rows(16, seed=5)
    task, data, runtime = dpo_task(tmp_path, chat_llama, rows, reference=Reference.precomputed)
    model = task.build_model().train()
    batch = data.collate_fn([data.train[i] for i in range(4)])
    first = task.step(model, batch).sample_losses
    saved = runtime.registered[0].state_dict()
    assert saved["table"].shape == (len(data.train) + len(data.eval), 2)
    # a resumed run: a new task on the same data, the state loaded, the weights moved on since the start
    again, _, runtime2 = dpo_task(tmp_path, chat_llama, rows, reference=Reference.precomputed)
    resumed = again.build_model().train()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    runtime2.registered[0].load_state_dict(saved)
    reference = again.reference(resumed, batch, logps_forward)
    assert torch.equal(reference, logps_forward(model, batch).detach())  # the starting weights' values
    assert not torch.allclose(reference, logps_forward(resumed, batch).detach())
    assert isinstance(again.reference, Precomputed) and again.reference.passes == 0
    assert torch.allclose(first, torch.full_like(first, math.log(2)), atol=1e-6)
    _, _, runtime3 = dpo_task(tmp_path / "other", chat_llama, preference_rows(16, seed=6),
                              reference=Reference.precomputed)
    with pytest.raises(ValueError, match="other pairs"):
        runtime3.registered[0].load_state_dict(saved)


def test_an_export_cannot_be_evaluated_against_values_it_does_not_hold(tmp_path, chat_llama):
    task, data, _ = dpo_task(tmp_path, chat_llama, preference_rows(8), reference=Reference.precomputed)
    model = task.build_model().eval()
    with pytest.raises(ConfigError, match="saved with the run's checkpoints"):
        task.evaluation_sums(model, data.collate_fn([data.eval[0]]))


def test_base_without_adapters_is_refused(tmp_path, chat_llama):
    task, data, _ = dpo_task(tmp_path, chat_llama, preference_rows(8), reference=Reference.base)
    with pytest.raises(ConfigError, match="give adapter=lora"):
        task.step(task.build_model(), data.collate_fn([data.train[0]]))


def test_the_explicit_implicit_and_string_forms(tmp_path, chat_llama):
    explicit, data, _ = dpo_task(tmp_path / "e", chat_llama, preference_rows(10, form="messages"))
    _, implicit, _ = dpo_task(tmp_path / "i", chat_llama, preference_rows(10, form="implicit"))
    for key in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"):
        assert data.train[key] == implicit.train[key]
    assert explicit.conversational
    tokenizer = explicit.tokenizer
    row = data.train[0]
    learnt = [t for t in row["chosen_labels"] if t != IGNORE_INDEX]
    text = tokenizer.decode(learnt)
    assert text.endswith("<|im_end|>") and "<|im_start|>" not in text and "what did" not in text
    strings, text_data, _ = dpo_task(tmp_path / "s", chat_llama, preference_rows(10, form="text"))
    row = text_data.train[0]
    assert not strings.conversational
    assert row["chosen_ids"][0] == tokenizer.bos_token_id and row["chosen_ids"][-1] == tokenizer.eos_token_id
    learnt = tokenizer.decode([t for t in row["chosen_labels"] if t != IGNORE_INDEX])
    whole = tokenizer.decode(row["chosen_ids"][1:])
    assert "?" not in learnt and learnt.endswith(" .</s>") and whole.endswith(learnt)  # the answer and EOS


@pytest.mark.parametrize("form", ["ultrafeedback", "string_prompt", "string_answers"])
def test_mixed_layouts_give_the_explicit_conversations_pairs(tmp_path, chat_llama, form):
    """UltraFeedback-binarized's layout (a string prompt; chosen/rejected as conversations that repeat it
    as their user turn; prompt_id, messages and scores beside them), a string prompt with assistant-only
    answers, and a user message with string answers: each trains on the pairs of the explicit form
    (the prompt as one user turn, each answer as one assistant turn), the other columns unread."""
    task, mixed, _ = dpo_task(tmp_path / form, chat_llama, preference_rows(10, form=form))
    _, explicit, _ = dpo_task(tmp_path / "explicit", chat_llama, preference_rows(10, form="messages"))
    assert task.conversational and len(mixed.train) == len(explicit.train) > 0
    for key in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"):
        assert list(mixed.train[key]) == list(explicit.train[key]) and list(mixed.eval[key]) == list(explicit.eval[key])


def test_a_string_prompt_that_its_conversations_do_not_begin_with_is_refused(tmp_path, chat_llama):
    rows = preference_rows(6, form="ultrafeedback")
    rows[4]["prompt"] = "what did the dog do ?"
    rows[4]["chosen"][0]["content"] = rows[4]["rejected"][0]["content"] = "what did the cat do ?"
    with pytest.raises(ConfigError, match="prefs.jsonl has 1 bad row\\(s\\) of 6: line 5: the 'prompt' string is none "
                                          "of the user turns that 'chosen' and 'rejected' begin with — "):
        dpo_task(tmp_path, chat_llama, rows)


@pytest.mark.parametrize(("change", "why"), [
    ({"chosen": [{"role": "assistant", "content": " "}]}, "line 3: the 'chosen' answer is empty"),
    ({"rejected": [{"role": "assistant", "content": "same"}], "chosen": [{"role": "assistant", "content": "same"}]},
     "line 3: the 'chosen' and 'rejected' answers are identical"),
    ({"rejected": [{"role": "user", "content": "hi"}]}, "line 3: the 'rejected' answer has no assistant turn"),
])
def test_a_bad_pair_is_refused_naming_its_file_and_line(tmp_path, chat_llama, change, why):
    rows = preference_rows(6)
    rows[2] = {**rows[2], **change}
    with pytest.raises(ConfigError, match="prefs.jsonl has 1 bad row\\(s\\) of 6: " + why + " — "):
        dpo_task(tmp_path, chat_llama, rows)


def test_encode_pairs_returns_each_bad_pairs_refusal_and_tokenizing_processes_hand_back_the_first(tmp_path,
                                                                                                   chat_llama):
    """A bad pair gets its sentence in the ``error`` column and empty lists, the good ones their rows as
    alone; with ``task.num_proc=2`` the run refuses the first bad pair (not a torn-down pool)."""
    from app.tasks.dpo.fit import PairFit
    from app.tasks.dpo.pairs import PairFields, encode_pairs
    from app.tasks.sft.records import Places

    rows = preference_rows(4)
    rows[1]["rejected"] = rows[1]["chosen"]
    rows[3]["chosen"] = [{"role": "assistant", "content": " "}]
    batch = {key: [row[key] for row in rows] for key in rows[0]}
    task, _, _ = dpo_task(tmp_path / "ok", chat_llama, preference_rows(4))
    fields = PairFields("prompt", "chosen", "rejected", PairFit(128), Places("f.jsonl", "line"))
    out = encode_pairs(batch, [10, 11, 12, 13], task.tokenizer, fields)
    assert out["error"] == ["", "f.jsonl line 12: the 'chosen' and 'rejected' answers are identical.", "",
                            "f.jsonl line 14: the 'chosen' answer is empty."]
    assert out["chosen_ids"][1] == out["rejected_labels"][3] == [] and out["answer_cut"] == [0, 0, 0, 0]
    alone = encode_pairs({key: [value[2]] for key, value in batch.items()}, [12], task.tokenizer, fields)
    assert alone["chosen_ids"][0] == out["chosen_ids"][2] and alone["rejected_labels"][0] == out["rejected_labels"][2]
    many = preference_rows(40)
    many[30]["rejected"] = many[30]["chosen"]
    with pytest.raises(ConfigError, match="prefs.jsonl has 1 bad row\\(s\\) of 40: line 31: the 'chosen' and 'rejected' "
                                          "answers are identical"):
        dpo_task(tmp_path / "procs", chat_llama, many, num_proc=2)


def test_options_are_checked():
    for options, why in (({"beta": 0.0}, "task.beta"), ({"packing": True, "streaming": True}, "packing"),
                         ({"loss_type": LossType.ipo, "label_smoothing": 0.1}, "label_smoothing")):
        cfg = DPOConfig(config="x", **options)
        cfg.data_files.train = "x.jsonl"
        with pytest.raises(ConfigError, match=why):
            cfg.check()


def test_field_names_and_the_held_out_share_are_the_configs(tmp_path, chat_llama):
    rows = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in preference_rows(30)]
    task, data, _ = dpo_task(tmp_path, chat_llama, rows, prompt_field="question", chosen_field="good",
                             rejected_field="bad", eval_fraction=0.2)
    assert (len(data.train), len(data.eval)) == (24, 6)
    assert sorted([*data.train["pair"], *data.eval["pair"]]) == list(range(30))
    assert "train: 30 pairs of" in " | ".join(task.data_summary())
    with pytest.raises(ConfigError, match="has no 'chosen' or 'rejected' column \\(it has question, good, bad\\)"):
        dpo_task(tmp_path / "missing", chat_llama, rows)


def test_a_streamed_file_gives_the_map_style_pairs_named_by_offset_and_resumes_exactly(tmp_path, chat_llama):
    """task.streaming=true: the pairs read line by line are the map-style ones (ids, labels), each named by
    its line's byte offset; the precomputed table holds them under that key (and the evaluation pairs
    under -1, -2…); a stream resumed from its saved position goes on with the next pair."""
    from app.tasks.dpo.stream import PairStream

    rows = preference_rows(14, seed=8)
    _, data, _ = dpo_task(tmp_path / "whole", chat_llama, rows, eval_fraction=0.0001)
    task, streamed, _ = dpo_task(tmp_path / "s", chat_llama, rows, streaming=True, eval_documents=3,
                                       reference=Reference.precomputed)
    assert isinstance(streamed.train, PairStream) and streamed.train_lengths is None
    assert list(streamed.eval["pair"]) == [-1, -2, -3]
    pairs = list(streamed.train)
    lines = (tmp_path / "s" / "prefs.jsonl").read_bytes().splitlines(keepends=True)
    offsets = [sum(len(line) for line in lines[:k]) for k in range(len(lines))]
    assert [p["pair"] for p in pairs] == offsets[3:]
    columns = ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")
    mapped = {tuple(tuple(r[c]) for c in columns) for split in (data.train, data.eval) for r in split}
    assert all(tuple(tuple(p[c]) for c in columns) in mapped for p in pairs)
    model = task.build_model().train()
    batch = streamed.collate_fn(pairs[4:8])
    reference = task.reference(model, batch, logps_forward)
    assert torch.allclose(reference, logps_forward(model, batch).detach(), atol=1e-6, rtol=0)
    assert task.reference.pairs_computed == len(pairs) + 3 and task.reference.keys.tolist() == [-3, -2, -1, *offsets[3:]]
    evaluation = streamed.collate_fn([streamed.eval[1]])
    assert torch.allclose(task.reference(model, evaluation, logps_forward), logps_forward(model, evaluation), atol=1e-6)
    # resume: a fresh stream at the saved position goes on with the next pair
    stream = streamed.train
    assert stream.state_dict()["offset"] == len(b"".join(lines))  # the pass read a copy: this one is where it was
    stream.set_shard(0, 1)  # from the start, as a loader's pass
    it = iter(stream)
    for _ in range(5):
        next(it)
    saved = stream.state_dict()
    again = dpo_task(tmp_path / "s", chat_llama, rows, streaming=True, eval_documents=3)[1].train
    again.load_state_dict(saved)
    assert [p["pair"] for p in again] == offsets[3 + 5:]


def test_a_bad_streamed_pair_is_refused_naming_its_byte_offset_or_skipped(tmp_path, chat_llama):
    """The stream's part is scanned before training: the bad pair refuses the run naming its byte offset, or
    with ``task.bad_rows=skip`` is left out of the stream and kept for ``skipped_rows.jsonl``."""
    rows = preference_rows(8, seed=9)
    rows[5]["rejected"] = rows[5]["chosen"]
    offset = sum(len(json.dumps(row)) + 1 for row in rows[:5])
    with pytest.raises(ConfigError, match=f"prefs.jsonl has 1 bad row\\(s\\) of 6: at byte {offset}: the 'chosen' and "
                                          "'rejected' answers are identical — "):
        dpo_task(tmp_path / "refuse", chat_llama, rows, streaming=True, eval_documents=2)
    task, streamed, _ = dpo_task(tmp_path / "skip", chat_llama, rows, streaming=True, eval_documents=2,
                                 bad_rows=BadRows.skip, max_bad_fraction=0.5)
    assert [pair["pair"] for pair in streamed.train] == [o for o in pair_offsets(rows) if o != offset][2:]
    assert [row["byte"] for row in task.skipped_rows()] == [offset]


def pair_offsets(rows: list[dict]) -> list[int]:
    """Each row's line's byte offset in the JSON Lines file ``write_jsonl`` writes."""
    offsets, at = [], 0
    for row in rows:
        offsets.append(at)
        at += len(json.dumps(row)) + 1
    return offsets




def test_tool_calls_in_the_answers_are_scored_and_a_tools_column_reaches_the_template(tmp_path):
    """A preference between a tool call (content null) and a plain answer, with the function's schema in a
    ``tools`` column, through Qwen2.5's real template (from TRL's wheel): the chosen side scores the tool call
    and its end-of-turn token, the rejected side its answer; the schemas are in the prompt, scored by neither."""
    trl_templates = pytest.importorskip("tests.helpers.trl_templates")
    pytest.importorskip("trl", reason="trl (whose wheel ships Qwen2.5's chat template) is not installed")
    model = make_tiny_chat_llama(tmp_path / "qwen", template=trl_templates.template("qwen2_5"))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    rows = [{"prompt": [{"role": "user", "content": f"what is the weather in Paris ? {k}"}],
             "chosen": [{"role": "assistant", "content": None, "tool_calls": [call]}],
             "rejected": [{"role": "assistant", "content": "it is sunny ."}],
             "tools": json.dumps(trl_templates.TOOLS)} for k in range(6)]
    task, data, _ = dpo_task(tmp_path / "run", model, rows, block_size=1024, eval_fraction=0.2)
    pair = data.train[0]
    tokenizer = task.tokenizer

    def scored(side: str) -> str:
        return tokenizer.decode([t for t in pair[f"{side}_labels"] if t != IGNORE_INDEX])

    assert scored("chosen") == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert scored("rejected") == "it is sunny .<|im_end|>"
    assert '"name": "get_weather", "description"' in tokenizer.decode(pair["chosen_ids"])
