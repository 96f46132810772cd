"""``task=sft`` in-process: what is learnt, found from the chat template alone, for three template
families and each data format; bad rows and unusable templates refused in one sentence naming file and
line; best-fit-decreasing packing; packed conversations that never see each other (SDPA and eager, the
positions path and the explicit 4-D mask), with a 2-D mask shown to contaminate; a model that ignores
the positions refused; and one optimizer step that is the same at batch 8 and at batch 2 x 4.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn

from app.config import ConfigError
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.causal_lm.task import token_losses
from app.tasks.sft.attention import check_isolation, model_inputs
from app.tasks.sft.config import DataFormat, Overlong, SFTConfig, TrainOn, TruncationMode
from app.tasks.sft.conversations import Fields
from app.tasks.sft.packing import PackedRows, SFTCollator, best_fit_decreasing
from app.tasks.sft.records import Places
from app.tasks.sft.tokens import Recipe, encode_rows
from tests.helpers.tiny_chat import (
    COUNTDOWN,
    END_OF_TURN,
    NO_END,
    TEMPLATES,
    conversations,
    make_tiny_chat_llama,
    make_tokenizer,
    write_jsonl,
)

FIELDS = Fields("messages", "prompt", "completion", "text")


def recipe(data_format: DataFormat, train_on: TrainOn = TrainOn.assistant, block_size: int = 1024,
           overlong: Overlong = Overlong.truncate) -> Recipe:
    return Recipe(data_format, FIELDS, train_on, block_size, overlong, Places("chat.jsonl", "line"))


def encode(tokenizer, rows: list[dict], r: Recipe) -> dict[str, list]:
    """``encode_rows`` on one batch, its first refusal raised (as ``tokenize_split`` does after the map)."""
    batch = {key: [row[key] for row in rows] for key in rows[0]}
    out = encode_rows(batch, list(range(len(rows))), tokenizer, r)
    error = next((e for e in out["error"] if e), None)
    if error is not None:
        raise ConfigError(error)
    return out


def learnt_runs(tokenizer, labels: list[int]) -> list[str]:
    """The learnt tokens, decoded run by run (a run: consecutive learnt tokens)."""
    runs: list[list[int]] = []
    previous = IGNORE_INDEX
    for label in labels:
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(label)
        previous = label
    return [tokenizer.decode(run) for run in runs]


def answers(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "assistant"]


# -- what is learnt --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(TEMPLATES))
@pytest.mark.parametrize("train_on", [TrainOn.assistant, TrainOn.last_assistant])
def test_the_learnt_tokens_are_the_assistant_contents_and_the_end_of_turn_token(family, train_on):
    """Conversations of 1 to 3 exchanges, half with a system message, in each template family (none of
    which has generation markers): every learnt run decodes to one answer and the end-of-turn token."""
    tokenizer = make_tokenizer(TEMPLATES[family])
    chats = conversations(12, seed=1)
    out = encode(tokenizer, [{"messages": c} for c in chats], recipe(DataFormat.messages, train_on))
    eot = END_OF_TURN[family]
    for chat, ids, labels, learnt in zip(chats, out["input_ids"], out["labels"], out["learnt"], strict=True):
        expected = [a + eot for a in answers(chat)]
        if train_on is TrainOn.last_assistant:
            expected = expected[-1:]
        # Llama-2's template puts a space before each answer, which BPE merges into the answer's first token
        assert [run.lstrip(" ") for run in learnt_runs(tokenizer, labels)] == expected
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(chat, tokenize=False)
        assert learnt == sum(label != IGNORE_INDEX for label in labels) > 0


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_prompt_completion_messages_learn_the_completion_and_all_learns_everything(family):
    tokenizer = make_tokenizer(TEMPLATES[family])
    chats = conversations(6, seed=2, max_turns=2)
    rows = [{"prompt": c[:-1], "completion": c[-1:]} for c in chats]
    for train_on in (TrainOn.completion, TrainOn.assistant):
        out = encode(tokenizer, rows, recipe(DataFormat.prompt_completion, train_on))
        for chat, labels in zip(chats, out["labels"], strict=True):
            assert [r.lstrip(" ") for r in learnt_runs(tokenizer, labels)] == [chat[-1]["content"] + END_OF_TURN[family]]
    out = encode(tokenizer, rows, recipe(DataFormat.prompt_completion, TrainOn.all))
    assert out["labels"] == out["input_ids"]


def test_string_pairs_and_text_are_framed_by_bos_and_a_learnt_eos():
    tokenizer = make_tokenizer()
    rows = [{"prompt": "what did the cat do ?", "completion": " the cat chased the red ball ."}]
    out = encode(tokenizer, rows, recipe(DataFormat.prompt_completion, TrainOn.completion))
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert learnt_runs(tokenizer, labels) == [" the cat chased the red ball .</s>"]
    text = encode(tokenizer, [{"text": "the cat chased the red ball ."}], recipe(DataFormat.text))
    assert text["labels"][0] == [IGNORE_INDEX, *text["input_ids"][0][1:]]  # all but BOS, which nothing predicts
    assert tokenizer.decode(text["input_ids"][0]) == "<s>the cat chased the red ball .</s>"


def test_the_format_is_read_from_the_columns_or_refused_naming_them():
    assert FIELDS.detect(["messages", "id"], DataFormat.auto, "a.jsonl") is DataFormat.messages
    assert FIELDS.detect(["prompt", "completion"], DataFormat.auto, "a.jsonl") is DataFormat.prompt_completion
    assert FIELDS.detect(["text"], DataFormat.auto, "a.jsonl") is DataFormat.text
    with pytest.raises(ValueError, match="a.jsonl has none of the columns .* \\(it has question, answer\\)"):
        FIELDS.detect(["question", "answer"], DataFormat.auto, "a.jsonl")


# -- refusals --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("template", "why"), [
    (COUNTDOWN, "renders the earlier turns differently once an assistant's turn follows them"),
    (NO_END, "ends an assistant turn with no special token"),
])
def test_a_template_whose_spans_cannot_be_found_is_refused_in_one_sentence(template, why):
    tokenizer = make_tokenizer(template)
    with pytest.raises(ConfigError, match=f"The chat template cannot be trained on .*{why}.*chat.jsonl line 1"):
        encode(tokenizer, [{"messages": c} for c in conversations(2, seed=3)], recipe(DataFormat.messages))


@pytest.mark.parametrize(("messages", "why"), [
    ([{"role": "user", "content": "hi"}, {"content": "hello"}], "message 2 of 'messages' has no 'role'"),
    ([{"role": "user"}, {"role": "assistant", "content": "hello"}], "message 1 of 'messages' has no 'content'"),
    ([{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, {"role": "assistant", "content": "a cat"}],
     "message 1 of 'messages' has a part of type 'image': training is on text only"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "tool call 1 of message 2 of 'messages' has no function name"),
    ([{"role": "user", "content": "hi"}], "it has no assistant turn to learn \\(task.train_on=assistant\\)"),
])
def test_a_bad_row_is_refused_naming_its_file_and_line(messages, why):
    tokenizer = make_tokenizer()
    good = {"messages": conversations(1)[0]}
    with pytest.raises(ConfigError, match=f"^chat.jsonl line 2: {why}"):
        encode(tokenizer, [good, {"messages": messages}, good], recipe(DataFormat.messages))


def test_any_role_the_template_renders_is_trained_and_one_it_refuses_or_drops_is_a_bad_row():
    """ChatML renders any role (``tool``, ``developer``...); Llama-2's raises on a role it does not know; a
    template that silently leaves a role out would train on something else than the row: refused."""
    chat = [{"role": "developer", "content": "answer in one sentence ."}, *conversations(1)[0]]
    out = encode(make_tokenizer(), [{"messages": chat}], recipe(DataFormat.messages))
    assert "<|im_start|>developer\nanswer in one sentence .<|im_end|>" in make_tokenizer().decode(out["input_ids"][0])
    with pytest.raises(ConfigError, match="^chat.jsonl line 1: the chat template cannot render it \\(TemplateError: "
                                          "unknown role developer\\)"):
        encode(make_tokenizer(TEMPLATES["llama2"]), [{"messages": chat}], recipe(DataFormat.messages))
    silent = TEMPLATES["llama2"].replace("{% else %}{{ raise_exception('unknown role ' + m['role']) }}", "")
    with pytest.raises(ConfigError, match="^chat.jsonl line 1: the chat template leaves out message 1 \\(role "
                                          "'developer'\\)"):
        encode(make_tokenizer(silent), [{"messages": chat}], recipe(DataFormat.messages))


def test_an_overlong_conversation_is_cut_dropped_or_refused_by_config():
    tokenizer = make_tokenizer()
    chat = conversations(1, seed=4, max_turns=1)[0]
    whole = encode(tokenizer, [{"messages": chat}], recipe(DataFormat.messages))
    n = len(whole["input_ids"][0])
    cut = encode(tokenizer, [{"messages": chat}], recipe(DataFormat.messages, block_size=n - 3))
    assert cut["input_ids"][0] == whole["input_ids"][0][:n - 3] and cut["cut"] == [1] and cut["learnt"][0] > 0
    dropped = encode(tokenizer, [{"messages": chat}], recipe(DataFormat.messages, block_size=n - 3,
                                                             overlong=Overlong.drop))
    assert dropped["learnt"] == [0]
    with pytest.raises(ConfigError, match=f"^chat.jsonl line 1 is {n} tokens long, more than task.block_size={n - 3}"):
        encode(tokenizer, [{"messages": chat}], recipe(DataFormat.messages, block_size=n - 3,
                                                       overlong=Overlong.refuse))


def test_train_on_completion_with_conversations_is_refused_when_composed():
    with pytest.raises(ConfigError, match="task.train_on=completion needs prompt/completion data"):
        SFTConfig(config="llama", data_files=SFTConfig().data_files.__class__(train="a.jsonl"),
                  format=DataFormat.messages, train_on=TrainOn.completion).check()


# -- packing ---------------------------------------------------------------------------------------------


def test_best_fit_decreasing_packs_every_conversation_once_into_few_rows():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(5, 120) for _ in range(300)]
    bins = best_fit_decreasing(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 128) * 1.05  # within 5 % of the lower bound


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    return make_tiny_chat_llama(tmp_path_factory.mktemp("chat_llama"), hidden=32, layers=2)


def tiny_model(folder: Path, attention: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), attn_implementation=attention).eval()


def packed_batch(tokenizer, train_on: TrainOn = TrainOn.assistant):
    """Nine conversations of different lengths packed into rows of 160 tokens, and the same one per row."""
    import datasets

    out = encode(tokenizer, [{"messages": c} for c in conversations(9, seed=5)], recipe(DataFormat.messages, train_on))
    rows = datasets.Dataset.from_dict({"input_ids": out["input_ids"], "labels": out["labels"]})
    packed = PackedRows(rows, 160)
    assert len(packed) < 9 and packed.conversations() == 9
    pad = tokenizer.eos_token_id
    return packed, SFTCollator(pad, 160)([packed[i] for i in range(len(packed))]), [rows[i] for i in range(9)], pad


def per_conversation_losses(model, batch, explicit_mask: bool = False, device: str | torch.device = "cpu"
                            ) -> dict[tuple[int, ...], float]:
    """Each conversation's summed learnt-token loss, keyed by its token ids; the model runs on ``device``
    (where the model is), the losses are split on the host."""
    on_device = {key: value.to(device) for key, value in batch.items()}
    with torch.no_grad():
        logits = model(**model_inputs(on_device, explicit_mask, torch.float32), use_cache=False).logits
        losses = token_losses(logits, on_device["labels"])[0].cpu()
    out = {}
    for row in range(batch["input_ids"].shape[0]):
        starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() if "position_ids" in batch else [0]
        ends = [*starts[1:], batch["input_ids"].shape[1]]
        for s, e in zip(starts, ends, strict=True):
            ids = batch["input_ids"][row, s:e]
            if "attention_mask" in batch and "position_ids" not in batch:
                ids = ids[batch["attention_mask"][row, s:e].bool()]
            out[tuple(ids.tolist())] = float(losses[row, s:e].double().sum())
    return out


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("explicit_mask", [False, True], ids=["positions", "4d_mask"])
def test_packing_changes_nothing_but_speed(chat_llama, attention, explicit_mask):
    """Each conversation's summed loss in packed rows equals the same conversation alone in a padded
    batch within 1e-5; with a 2-D mask (all ones) the packed rows are contaminated, and this shows it."""
    tokenizer = make_tokenizer()
    model = tiny_model(chat_llama, attention)
    _, batch, rows, pad = packed_batch(tokenizer)
    packed = per_conversation_losses(model, batch, explicit_mask)
    alone = per_conversation_losses(model, SFTCollator(pad)(rows))
    conversations_alone = {k: v for k, v in alone.items()}
    paddings = [k for k in packed if k not in conversations_alone]  # each row's padding tail
    assert all(packed[k] == 0.0 for k in paddings)
    assert len(packed) - len(paddings) == 9
    for key, loss in conversations_alone.items():
        assert packed[key] == pytest.approx(loss, abs=1e-5, rel=1e-6)
    contaminated = per_conversation_losses(model, {**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    gaps = [abs(contaminated[k] - loss) for k, loss in conversations_alone.items()]
    assert max(gaps) > 1e-2  # the 2-D mask turns the packed-sequence detection off: conversations see each other


def test_the_engine_loss_of_a_packed_batch_counts_the_same_tokens(chat_llama):
    """train_on=all: a conversation's first token is learnt alone but predicted by nothing, so packed
    it must not become the previous conversation's target: the same tokens count packed and apart."""
    tokenizer = make_tokenizer()
    _, batch, rows, pad = packed_batch(tokenizer, TrainOn.all)
    apart = SFTCollator(pad)(rows)
    targets = [b["labels"][:, 1:] for b in (batch, apart)]  # what the loss predicts (token_losses' shift)
    assert (targets[0] != IGNORE_INDEX).sum() == (targets[1] != IGNORE_INDEX).sum() > 0


class IgnoresPositions(nn.Module):
    """A model whose attention does not follow per-conversation positions (custom code would be one)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return self.model(input_ids=input_ids, use_cache=use_cache)


def test_a_model_that_would_let_packed_conversations_meet_is_refused(chat_llama):
    model = tiny_model(chat_llama, "sdpa")
    check_isolation(model, explicit_mask=False)
    check_isolation(model, explicit_mask=True)
    with pytest.raises(ConfigError, match="lets a packed conversation attend to the one before it.*task.packing=false"):
        check_isolation(IgnoresPositions(model), explicit_mask=False)


# -- the run, in process ---------------------------------------------------------------------------------


class OneProcess:
    """The runtime as a task sees it in build_data, on one process."""

    is_main_process = True
    static_shapes = False

    def main_process_first(self):
        return nullcontext()

    def register_for_checkpointing(self, *objects) -> None:
        pass


def test_build_data_reads_holds_out_and_says_what_was_dropped(tmp_path, chat_llama):
    from app.tasks.sft.task import SFTTask

    chats = conversations(40, seed=6)
    rows = [{"messages": c} for c in chats] + [{"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": ""}]}]
    train = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = SFTConfig(config=str(chat_llama), cache_dir=str(tmp_path / "cache"), block_size=256, packing=True)
    cfg.data_files.train = str(train)
    task = SFTTask(cfg)
    data = task.build_data(OneProcess())
    assert isinstance(data.train, PackedRows) and isinstance(data.eval, PackedRows)
    assert data.train.conversations() + data.eval.conversations() == 41  # the empty answer still learns <|im_end|>
    assert data.eval.conversations() == 5  # ceil(0.1 * 41)
    summary = " | ".join(task.data_summary())
    assert "train: 41 conversations of" in summary and "packed: 36 training conversations into" in summary
    model = task.build_model()
    batch = data.collate_fn([data.train[0], data.train[1]])
    out = task.step(model, batch)
    assert out.sample_items.tolist() == [(t != IGNORE_INDEX).sum().item() for t in batch["labels"][:, 1:]]


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_an_answer_its_turns_frame_also_holds_is_located_by_the_marker(family):
    """An answer such as "s" stands twice in Llama-2's turn " s</s>" (and "|" in ChatML's markers): the
    content is then located from the turn rendered with a marker as its content."""
    tokenizer = make_tokenizer(TEMPLATES[family])
    for answer in ("s", "im", "|", "assistant"):
        chat = [{"role": "user", "content": "what did the cat do ?"}, {"role": "assistant", "content": answer}]
        out = encode(tokenizer, [{"messages": chat}], recipe(DataFormat.messages))
        assert [r.lstrip(" ") for r in learnt_runs(tokenizer, out["labels"][0])] == [answer + END_OF_TURN[family]]


MARKED = (TEMPLATES["chatml"].replace("{% for message in messages %}", "{% for message in messages %}{% generation %}")
          .replace("{% endfor %}", "{% endgeneration %}{% endfor %}"))
"""ChatML with TRL's generation markers (transformers' extension, which our render must know too)."""


@pytest.mark.parametrize("template", [*TEMPLATES.values(), COUNTDOWN, NO_END, MARKED])
def test_the_span_finders_render_is_apply_chat_templates(template):
    """The template compiled once and rendered directly (render.py) gives apply_chat_template's text, with
    and without the generation prompt, for every prefix of conversations with and without a system turn."""
    from app.tasks.sft.render import Template

    tokenizer = make_tokenizer(template)
    render = Template(tokenizer)
    for chat in conversations(4, seed=5):
        for k in range(1, len(chat) + 1):
            for prompt in (False, True):
                assert render(chat[:k], prompt) == tokenizer.apply_chat_template(chat[:k], tokenize=False,
                                                                                 add_generation_prompt=prompt)


def test_a_token_is_learnt_where_it_overlaps_a_learnt_range():
    """Byte-level tokens of one multi-byte character share its offsets: each is learnt as the rule says
    (overlap with a learnt range, no extent never), checked against the rule written out per token."""
    from app.tasks.sft.tokens import learnt_labels

    tokenizer = make_tokenizer()
    text = "ab ☕ café 日本 cd"
    encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    assert offsets[0] == (0, 0) and len(set(offsets)) < len(offsets)  # BOS, and tokens sharing a character
    for ranges in ([], [(0, len(text))], [(3, 4)], [(4, 5), (9, 11)], [(0, 1), (11, len(text))]):
        expected = [t if e > b and any(e > s and b < f for s, f in ranges) else IGNORE_INDEX
                    for t, (b, e) in zip(ids, offsets, strict=True)]
        assert learnt_labels(ids, offsets, ranges, len(text)) == expected


def test_without_transformers_compiler_the_render_falls_back_to_apply_chat_template(monkeypatch):
    """A transformers whose module lacks the (private) compiler: the render is apply_chat_template's own."""
    import sys
    import types

    from app.tasks.sft.render import Template

    tokenizer = make_tokenizer(TEMPLATES["llama3"])
    fast = Template(tokenizer)
    monkeypatch.setitem(sys.modules, "transformers.utils.chat_template_utils", types.ModuleType("without_it"))
    fallback = Template(tokenizer)
    chat = conversations(1, seed=6)[0]
    expected = tokenizer.apply_chat_template(chat, tokenize=False)
    calls = []
    apply = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or apply(*a, **k))
    assert fast(chat, False) == expected and not calls
    assert fallback(chat, False) == expected and calls == [1]


@pytest.mark.parametrize("mode", list(TruncationMode))
def test_a_long_prompt_is_cut_to_max_prompt_length_keeping_its_bos_and_the_completion(mode):
    """Prompt/completion data: the prompt (tokens before the completion) is cut to task.max_prompt_length
    before the row meets the block, from the start (keep_end: the question nearest the answer stays) or the end;
    the completion and its EOS are whole; conversations (the same pair as messages) alike."""
    tokenizer = make_tokenizer()
    question = "what did the cat do ? " * 30 + "and the dog ?"
    rows = [{"prompt": question, "completion": " a dog found a tiny seed ."}]
    r = Recipe(DataFormat.prompt_completion, FIELDS, TrainOn.completion, 64, Overlong.truncate,
               Places("chat.jsonl", "line"), max_prompt_length=16, truncation_mode=mode)
    whole = encode(tokenizer, rows, recipe(DataFormat.prompt_completion, TrainOn.completion))
    out = encode(tokenizer, rows, r)
    ids, labels = out["input_ids"][0], out["labels"][0]
    prompt = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert prompt == 16 and ids[0] == tokenizer.bos_token_id and out["prompt_cut"] == [1] and out["cut"] == [0]
    whole_ids = whole["input_ids"][0]
    whole_prompt = next(i for i, label in enumerate(whole["labels"][0]) if label != IGNORE_INDEX)
    kept = whole_ids[whole_prompt - 15:whole_prompt] if mode is TruncationMode.keep_end else whole_ids[1:16]
    assert ids[1:16] == kept and ids[16:] == whole_ids[whole_prompt:]
    assert learnt_runs(tokenizer, labels) == [" a dog found a tiny seed .</s>"]
    chats = [{"prompt": [{"role": "user", "content": question}],
              "completion": [{"role": "assistant", "content": "a dog found a tiny seed ."}]}]
    conversation = encode(tokenizer, chats, r)
    assert conversation["prompt_cut"] == [1] and learnt_runs(tokenizer, conversation["labels"][0]) == \
        ["a dog found a tiny seed .<|im_end|>"]
    with pytest.raises(ConfigError, match="task.max_prompt_length cuts the prompt of prompt/completion data"):
        SFTConfig(config="llama", data_files=SFTConfig().data_files.__class__(train="a.jsonl"),
                  format=DataFormat.messages, max_prompt_length=16).check()


def test_a_template_with_generation_markers_is_learnt_from_them_and_the_span_finder_checked():
    """ChatML with markers around every whole message (headers and user turns included): the markers say what is
    learnt for each assistant turn (its header too, here); the span finder's span (the content and end-of-turn
    token) differs for every turn, and the row counts each disagreement for the log."""
    tokenizer = make_tokenizer(MARKED)
    chats = conversations(6, seed=12)
    out = encode(tokenizer, [{"messages": c} for c in chats], recipe(DataFormat.messages))
    for chat, labels, disagreements in zip(chats, out["labels"], out["disagreements"], strict=True):
        runs = learnt_runs(tokenizer, labels)
        assert runs == [f"<|im_start|>assistant\n{a}<|im_end|>" for a in answers(chat)]
        assert disagreements == len(answers(chat))
    plain = encode(make_tokenizer(), [{"messages": c} for c in chats], recipe(DataFormat.messages))
    assert plain["disagreements"] == [0] * len(chats)
