"""Every text chat template TRL 1.16 ships (``trl/chat_templates/*.jinja``, read from the installed wheel) trains,
and learns the tokens TRL's ``_training`` variant of it marks with ``{% generation %}``.

For each template: multi-turn conversations with and without a system message, with reasoning, and with a tool
call and its result (where the template renders tool calls; where it cannot, the row is refused in one sentence)
are formatted by ``encode_rows`` with the *original* template, as a user's tokenizer carries it. The reference is
transformers' own rendering of the training variant (``return_assistant_tokens_mask``'s ranges): each assistant
turn as the conversation ending with it renders, what TRL marks in its last turn learnt. Compared token by token
(each learnt token with everything before it) and by the loss of a tiny model at initialisation over the epoch,
one conversation per row and packed into one row.

Where TRL's marks and ours differ, on purpose (the test lists each case, so that no other difference passes):
- a block that opens with part of the generation prompt or of the history (Qwen2.5's newline, DeepSeek-V3's
  ``<｜Assistant｜>`` and the ``<｜tool▁outputs▁end｜>`` that closes a tool's result, Nemotron's ``<think>``): the
  model is given it at inference, not writes it; the reference leaves it out;
- the newline after a block's last token: no output of the model (the issue's "without a trailing newline");
- Phi-3 closes a conversation with EOS after the last turn's ``<|end|>\\n``: learnt as that turn renders, the
  newline between them too;
- DiffusionGemma after a tool call writes ``<|tool_response>`` (where the model stops for the result) and, after a
  result, ``<|turn>model\\n`` with no generation prompt to give it: both are what the model must write.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections import Counter

import pytest
import torch

from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.causal_lm.task import token_losses
from app.tasks.sft.config import DataFormat, Overlong, TrainOn
from app.tasks.sft.conversations import Fields, messages
from app.tasks.sft.packing import SFTCollator, packed_row
from app.tasks.sft.records import Places
from app.tasks.sft.spans import arguments_as_text
from app.tasks.sft.tokens import Recipe, encode_rows, learnt_labels

trl_templates = pytest.importorskip("tests.helpers.trl_templates")
pytest.importorskip("trl", reason="trl (whose wheel ships the chat templates) is not installed")

RECIPE = Recipe(DataFormat.messages, Fields("messages", "prompt", "completion", "text"), TrainOn.assistant, 4096,
                Overlong.truncate, Places("chat.jsonl", "line"))
NO_TOOLS = {"cohere", "cohere2", "deepseek_r1_distill", "gemma", "gemma3", "lfm2", "llama3", "phi3", "phi3_5"}
"""Templates that cannot render a tool call and its result (they raise, or drop the call): the row is refused."""
NO_SYSTEM = {"gemma"}
"""Templates that refuse a system message."""
EXTRA = {"phi3": ("\n",), "phi3_5": ("\n",), "diffusion_gemma": ("<|tool_response>", "<|turn>model\n")}
"""What we learn beyond TRL's marks, by template (see the docstring): each extra token is part of one of these."""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model's forward on one thread: two threads beside other work on 2 cores take ten times longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def shapes(name: str) -> dict[str, tuple[list[dict], list[dict] | None]]:
    return {"plain": (trl_templates.plain(False), None), "system": (trl_templates.plain(True), None),
            "reasoning": (trl_templates.reasoning(), None), "tools": (trl_templates.tool_use(), trl_templates.TOOLS)}


def ours(tokenizer, chat: list[dict], tools: list[dict] | None) -> tuple[list[tuple[list[int], list[int]]], str]:
    batch = {"messages": [chat], **({"tools": [tools]} if tools else {})}
    out = encode_rows(batch, [0], tokenizer, RECIPE)
    # A template with generation markers (LFM2.5's) is learnt from them: the span finder must agree with them.
    assert sum(out["disagreements"]) == 0, "the span finder places a turn otherwise than the template's markers"
    return list(zip(out["input_ids"], out["labels"], strict=True)), out["error"][0]


def reference(tokenizer, name: str, chat: list[dict], tools: list[dict] | None) -> list[tuple[list[int], list[int]]]:
    """Each assistant turn as the original template renders the conversation ending with it, the tokens TRL's
    variant marks in that turn learnt (less the generation prompt and trailing whitespace)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    variant = trl_templates.training_variant(name)
    context = dict(tokenizer.special_tokens_map)
    chat = messages(chat, "messages")  # as the task reads a row: tool calls' content "", reasoning aliased
    original = chat
    try:
        tokenizer.apply_chat_template(chat, tools=tools, tokenize=False)
    except TypeError:  # DeepSeek-V3's original takes tool-call arguments as text (its variant, as an object)
        original = arguments_as_text(chat)
    rows = []
    for k, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        text = tokenizer.apply_chat_template(original[:k + 1], tools=tools, tokenize=False)
        given = tokenizer.apply_chat_template(original[:k], tools=tools, tokenize=False, add_generation_prompt=True) \
            if k else ""
        (marked,), (blocks,) = render_jinja_template([chat[:k + 1]], tools=tools, chat_template=variant,
                                                     return_assistant_tokens_mask=True, **context)
        (history,), _ = render_jinja_template([chat[:k]], tools=tools, chat_template=variant, **context) if k \
            else (("",), None)
        opened = len(os.path.commonprefix([history, marked]))  # where the last turn starts in the variant's text
        turn = marked[opened:].rstrip()
        if not text.rstrip().endswith(turn):  # GLM-4: the variant closes the last turn with the next opener
            closing = trl_templates.CONTROL.findall(turn)[-1]
            assert (text.rstrip() + closing).endswith(turn), (name, k, text[-80:], turn[-80:])
            text = text.rstrip() + closing
        shift = len(text.rstrip()) - len(turn) - opened
        start = len(os.path.commonprefix([given, text]))
        ranges = [(max(a, opened) + shift, a + shift + len(marked[a:b].rstrip())) for a, b in blocks if b > opened]
        ranges = [(max(a, start), b) for a, b in ranges]
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        rows.append((ids, learnt_labels(ids, encoded["offset_mapping"], [r for r in ranges if r[1] > r[0]], len(text))))
    return rows


def learnt(rows: list[tuple[list[int], list[int]]]) -> Counter:
    """Each learnt token with everything before it in its row (what its loss depends on)."""
    return Counter(tuple(ids[:i + 1]) for ids, labels in rows for i, label in enumerate(labels)
                   if label != IGNORE_INDEX)


@functools.cache
def tiny_model(vocabulary: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocabulary, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def token_loss(model, rows: list[dict]) -> dict[tuple[int, ...], float]:
    """Each learnt token's loss (keyed as :func:`learnt`), one row at a time or packed (``position_ids``)."""
    out = {}
    for row in rows:
        batch = SFTCollator(0)([row])
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        losses, targets = token_losses(model(**inputs, use_cache=False).logits.float(), batch["labels"])
        ids = row["input_ids"]
        starts = [i for i, p in enumerate(row.get("position_ids", [0])) if p == 0] + [len(ids)]
        for begin, end in itertools.pairwise(starts):
            for i in range(begin + 1, end):
                if targets[0, i - 1] != IGNORE_INDEX:
                    out[tuple(ids[begin:i + 1])] = losses[0, i - 1].item()
    return out


@pytest.mark.parametrize("name", trl_templates.text_templates())
def test_every_shipped_template_trains_the_tokens_its_training_variant_marks(name):
    tokenizer = trl_templates.make_tokenizer(name)
    mine: list[tuple[list[int], list[int]]] = []
    theirs: list[tuple[list[int], list[int]]] = []
    for shape, (chat, tools) in shapes(name).items():
        rows, error = ours(tokenizer, chat, tools)
        refused = (shape == "tools" and name in NO_TOOLS) or (shape == "system" and name in NO_SYSTEM)
        if refused:
            assert error.startswith("chat.jsonl line 1: the chat template"), (shape, error)
            continue
        assert not error, (shape, error)
        mine += rows
        if trl_templates.training_variant(name) is not None:
            theirs += reference(tokenizer, name, chat, tools)
    assert sum(labels.count(IGNORE_INDEX) < len(labels) for _, labels in mine) >= 1
    if not theirs:  # no training variant (Gemma 4, Llama 3.1/3.2): each learnt run ends with a special token
        for ids, labels in mine:
            ends = [i for i in range(len(labels)) if labels[i] != IGNORE_INDEX
                    and (i + 1 == len(labels) or labels[i + 1] == IGNORE_INDEX)]
            assert all(tokenizer.convert_ids_to_tokens(ids[i]) in tokenizer.all_special_tokens for i in ends)
        return
    ours_learnt, their_learnt = learnt(mine), learnt(theirs)
    assert not their_learnt - ours_learnt, f"{name}: TRL marks tokens we do not learn"
    extra = {tokenizer.decode([key[-1]]) for key in ours_learnt - their_learnt}
    unexplained = {t for t in extra if not any(t in allowed for allowed in EXTRA.get(name, ()))}
    assert not unexplained, f"{name}: we learn {unexplained} beyond TRL's marks"

    model = tiny_model(len(tokenizer))
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in mine]
    ours_loss = token_loss(model, rows)
    their_loss = token_loss(model, [{"input_ids": ids, "labels": labels} for ids, labels in theirs])
    common = sorted(set(ours_loss) & set(their_loss))
    mean = sum(ours_loss[k] for k in common) / len(common)
    assert mean == pytest.approx(sum(their_loss[k] for k in common) / len(common), rel=1e-6)
    if not extra:  # the epoch's loss is the loss over TRL's tokens
        assert sum(ours_loss.values()) / len(ours_loss) == pytest.approx(mean, rel=1e-6)
    packed = token_loss(model, [packed_row([r["input_ids"] for r in rows], [r["labels"] for r in rows])])
    assert set(packed) == set(ours_loss)
    assert sum(packed.values()) == pytest.approx(sum(ours_loss.values()), rel=1e-5)
