"""Conversations as people's files have them (issue 47): tool calls (content null beside ``tool_calls``, a ``tool``
message with ``name`` and ``tool_call_id``), a ``tools`` column of function schemas (a list, or its JSON text),
arguments as an object or as OpenAI's JSON text, content as a list of text parts, ShareGPT's ``from``/``value``,
reasoning fields. What is learnt: the assistant's tool-call turns and answers, never a tool's result. Rendered as
``apply_chat_template(tools=...)`` renders them, with Qwen2.5's real template (read from TRL's wheel). And a
tool-calling file, written here, trains: the export, loaded with Transformers alone, answers a new question with a
tool call in the format it was trained on."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from app.tasks.sft.config import DataFormat, Overlong, TrainOn
from app.tasks.sft.conversations import Fields, messages
from app.tasks.sft.records import Places
from app.tasks.sft.render import Template
from app.tasks.sft.tokens import Recipe
from tests.conftest import run_app
from tests.helpers.tiny_chat import make_tiny_chat_llama, make_tokenizer, write_jsonl
from tests.test_sft import encode, learnt_runs, recipe

trl_templates = pytest.importorskip("tests.helpers.trl_templates")
pytest.importorskip("trl", reason="trl (whose wheel ships Qwen2.5's chat template) is not installed")

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")
CITIES = ["Paris", "Rome", "Oslo", "Lima"]
WEATHER = ["sunny", "rainy", "windy"]
TOOLS = trl_templates.TOOLS


def weather_chat(rng: random.Random, null_content: bool = True, text_arguments: bool = False) -> list[dict]:
    city, weather = rng.choice(CITIES), rng.choice(WEATHER)
    arguments: object = {"city": city}
    return [{"role": "user", "content": f"what is the weather in {city} ?"},
            {"role": "assistant", "content": None if null_content else "",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": json.dumps(arguments) if text_arguments else arguments}}]},
            {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": weather},
            {"role": "assistant", "content": f"it is {weather} in {city} ."}]


def qwen_tokenizer():
    return make_tokenizer(trl_templates.template("qwen2_5"))


def test_tool_calls_render_as_apply_chat_template_renders_them():
    """Our compiled render of the messages as the task reads them is apply_chat_template's, with tools, for every
    prefix, with and without the generation prompt."""
    tokenizer = qwen_tokenizer()
    render = Template(tokenizer)
    chat = messages(weather_chat(random.Random(0), null_content=False), "messages")
    for k in range(1, len(chat) + 1):
        for prompt in (False, True):
            assert render(chat[:k], prompt, TOOLS) == tokenizer.apply_chat_template(
                chat[:k], tools=TOOLS, tokenize=False, add_generation_prompt=prompt)


@pytest.mark.parametrize(("null_content", "text_arguments", "tools_as_text"),
                         [(True, False, False), (False, True, True)])
def test_the_tool_call_and_the_answer_are_learnt_the_tool_result_never(null_content, text_arguments, tools_as_text):
    tokenizer = qwen_tokenizer()
    chat = weather_chat(random.Random(1), null_content, text_arguments)
    tools = json.dumps(TOOLS) if tools_as_text else TOOLS
    out = encode(tokenizer, [{"messages": chat, "tools": tools}], recipe(DataFormat.messages))
    runs = learnt_runs(tokenizer, out["labels"][0])
    city = chat[0]["content"].split()[-2]
    assert runs == [f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call><|im_end|>',
                    f"{chat[3]['content']}<|im_end|>"]
    text = tokenizer.decode(out["input_ids"][0])
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # the schemas, in the system turn
    assert f"<tool_response>\n{chat[2]['content']}\n</tool_response>" in text and "tool_response" not in "".join(runs)


def test_sharegpt_text_parts_and_reasoning_read_as_messages():
    """ShareGPT's ``conversations`` of ``from``/``value`` (human, gpt), content given as text parts, and a
    reasoning field: read as the same messages the plain form gives (the reasoning aliased as templates read it)."""
    plain = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello ."}]
    sharegpt = [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello ."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "hello ."}]}]
    assert messages(sharegpt, "conversations") == messages(parts, "messages") == plain
    reasoned = messages([plain[0], {**plain[1], "reasoning": "be kind"}], "messages")[1]
    assert reasoned["reasoning_content"] == reasoned["thinking"] == "be kind" and "reasoning" not in reasoned
    tokenizer = make_tokenizer()
    fields = Fields("messages", "prompt", "completion", "text").with_messages(["conversations", "id"])
    sharegpt_recipe = Recipe(DataFormat.messages, fields, TrainOn.assistant, 1024, Overlong.truncate,
                             Places("chat.jsonl", "line"))
    out = encode(tokenizer, [{"conversations": sharegpt, "id": 7}], sharegpt_recipe)
    assert learnt_runs(tokenizer, out["labels"][0]) == ["hello .<|im_end|>"]


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tools")
    model = make_tiny_chat_llama(folder / "base", hidden=64)
    template = folder / "qwen2_5.jinja"
    template.write_text(trl_templates.template("qwen2_5"), encoding="utf-8")
    rng = random.Random(3)
    # No tools column here (the unit tests above have one): its schemas make Qwen2.5's system turn 450 tokens of
    # this toy tokenizer, three times the rest of a conversation.
    rows = [{"messages": weather_chat(rng, null_content=rng.random() < 0.5, text_arguments=rng.random() < 0.5)}
            for _ in range(240)]
    write_jsonl(folder / "tools.jsonl", rows)
    run = folder / "run"
    proc = run_app("task=sft", f"task.config={model}", f"task.chat_template={template}",
                   f"task.data_files.train={folder / 'tools.jsonl'}", "task.block_size=256", "task.packing=true",
                   "trainer.max_epochs=6", "trainer.batch_size=4", "optim.lr=3e-3", f"task.cache_dir={folder / 'cache'}",
                   *QUIET, f"hydra.run.dir={run}", cwd=folder, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_a_tool_calling_file_trains_and_the_export_calls_the_tool_in_the_trained_format(tool_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = (tool_run / "app.log").read_text()
    assert "learnt spans from the template's rendering, turn by turn" in log
    tokenizer = AutoTokenizer.from_pretrained(tool_run / "model")
    model = AutoModelForCausalLM.from_pretrained(tool_run / "model").eval()
    calls = 0
    for city in CITIES:
        chat = [{"role": "user", "content": f"what is the weather in {city} ?"}]
        inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=100, do_sample=False)
        answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
        call = re.fullmatch(r"<tool_call>\n(\{.*\})\n</tool_call><\|im_end\|>", answer, flags=re.DOTALL)
        assert call is not None, answer
        parsed = json.loads(call.group(1))
        assert parsed["name"] == "get_weather" and parsed["arguments"]["city"] in CITIES
        calls += parsed["arguments"]["city"] == city
    assert calls >= 2  # the question's city, most of the time, for a model this small
