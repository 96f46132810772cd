"""Long prompts in ``task=dpo``: ``truncation.cut_prompt`` cuts the tokens before the first learnt one
(``keep_end``: its last, ``keep_start``: its first; a leading BOS stays); a pair whose prompt is ten times
the block trains with its prompt cut to half the block (both sides alike, the question nearest the
answer kept), or to ``task.max_prompt_length``; with ``task.overlong=drop`` it is left out and counted,
with ``refuse`` refused naming its line; a streamed file alike; the log's ``data:`` line counts each once."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import ConfigError
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.dpo.config import DPOConfig
from app.tasks.sft.config import Overlong, TruncationMode
from app.tasks.sft.truncation import cut_prompt
from tests.conftest import run_app
from tests.helpers.dpo_pairs import preference_rows
from tests.helpers.tiny_chat import make_tiny_chat_llama, write_jsonl
from tests.test_dpo import dpo_task

X = IGNORE_INDEX
QUESTION = "what did the cat do today ?"


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    return make_tiny_chat_llama(tmp_path_factory.mktemp("dpo_long") / "base")


def test_cut_prompt_keeps_the_end_or_the_start_and_a_leading_bos():
    ids, labels = [1, 10, 11, 12, 13, 14, 20, 21], [X, X, X, X, X, X, 20, 21]
    assert cut_prompt(ids, labels, 3, TruncationMode.keep_end) == ([12, 13, 14, 20, 21], [X, X, X, 20, 21])
    assert cut_prompt(ids, labels, 3, TruncationMode.keep_start) == ([1, 10, 11, 20, 21], [X, X, X, 20, 21])
    assert cut_prompt(ids, labels, 3, TruncationMode.keep_end, bos=1) == ([1, 13, 14, 20, 21], [X, X, X, 20, 21])
    assert cut_prompt(ids, labels, 3, TruncationMode.keep_start, bos=1) == ([1, 10, 11, 20, 21], [X, X, X, 20, 21])
    assert cut_prompt(ids, labels, 1, TruncationMode.keep_end, bos=1) == ([1, 20, 21], [X, 20, 21])
    assert cut_prompt(ids, labels, 6, TruncationMode.keep_end, bos=1) == (ids, labels)  # not longer: unchanged
    assert cut_prompt(ids, [X] * 8, 2, TruncationMode.keep_end) == (ids, [X] * 8)  # nothing learnt: no prompt
    with pytest.raises(ValueError):
        cut_prompt(ids, labels, 0, TruncationMode.keep_end)


def long_rows(form: str = "messages") -> list[dict]:
    """Ten toy pairs, the fourth's prompt about ten blocks of 128 tokens long, ending with its question."""
    rows = preference_rows(10, form=form)
    filler = "the dog saw the bird in the park and the cat sat on the mat . " * 110
    if form == "text":
        rows[3]["prompt"] = filler + QUESTION + " "
    else:
        rows[3]["prompt"] = [{"role": "user", "content": filler + QUESTION}]
    return rows


def prompt_of(tokenizer, ids: list[int], labels: list[int]) -> str:
    first = next(i for i, label in enumerate(labels) if label != X)
    return tokenizer.decode(ids[:first])


def test_a_prompt_ten_times_the_block_is_cut_to_half_of_it_keeping_its_end(tmp_path, chat_llama):
    task, data, _ = dpo_task(tmp_path, chat_llama, long_rows(), eval_fraction=0.0001)
    pairs = [*data.train, *data.eval]
    assert len(pairs) == 10
    assert len(task.tokenizer(long_rows()[3]["prompt"][0]["content"])["input_ids"]) >= 10 * 128
    (pair,) = [p for p in pairs if QUESTION in prompt_of(task.tokenizer, p["chosen_ids"], p["chosen_labels"])]
    assert all(len(p[f"{side}_ids"]) <= 128 for p in pairs for side in ("chosen", "rejected"))
    chosen = prompt_of(task.tokenizer, pair["chosen_ids"], pair["chosen_labels"])
    rejected = prompt_of(task.tokenizer, pair["rejected_ids"], pair["rejected_labels"])
    assert chosen == rejected and chosen.endswith(f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert pair["chosen_labels"].index(next(t for t in pair["chosen_labels"] if t != X)) == 64  # half the block
    assert not chosen.startswith("<|im_start|>user")  # its start went
    assert task.tokenizer.decode([t for t in pair["chosen_labels"] if t != X]).endswith(" .<|im_end|>")  # answer whole
    summary = " | ".join(task.data_summary())
    assert ("train: 10 pairs of" in summary and "1 with their prompt cut (to half of task.block_size=128, keep_end)"
            in summary and "answer cut" not in summary and "dropped" not in summary)


def test_max_prompt_length_cuts_every_longer_prompt_keep_start_keeps_the_bos(tmp_path, chat_llama):
    task, data, _ = dpo_task(tmp_path, chat_llama, long_rows("text"), max_prompt_length=12,
                             truncation_mode=TruncationMode.keep_start, eval_fraction=0.0001)
    tokenizer = task.tokenizer
    pairs = [*data.train, *data.eval]
    assert len(pairs) == 10
    for pair in pairs:
        for side in ("chosen", "rejected"):
            ids, labels = pair[f"{side}_ids"], pair[f"{side}_labels"]
            assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id  # BOS kept, answer whole
            assert next(i for i, label in enumerate(labels) if label != X) <= 12
    starts = [prompt_of(tokenizer, p["chosen_ids"][1:], p["chosen_labels"][1:]) for p in pairs]
    assert sum(s.startswith("the dog saw the bird") for s in starts) == 1  # keep_start: the filler's beginning
    summary = " | ".join(task.data_summary())
    assert "with their prompt cut (task.max_prompt_length=12, keep_start)" in summary


def test_overlong_drop_leaves_the_pair_out_and_counts_it_refuse_names_it(tmp_path, chat_llama):
    task, data, _ = dpo_task(tmp_path / "drop", chat_llama, long_rows(), overlong=Overlong.drop,
                             eval_fraction=0.0001)
    assert len(data.train) + len(data.eval) == 9
    assert not any(QUESTION in task.tokenizer.decode(p["chosen_ids"]) for p in [*data.train, *data.eval])
    summary = " | ".join(task.data_summary())
    assert "train: 9 pairs of" in summary and "1 dropped as longer than task.block_size=128 (task.overlong=drop)" \
        in summary and "prompt cut" not in summary
    with pytest.raises(ConfigError, match=r"prefs.jsonl has 1 bad row\(s\) of \d+: line 4: its chosen side is \d+ tokens "
                                          r"long, more than "
                                          r"task.block_size=128 \(task.overlong=refuse\)"):
        dpo_task(tmp_path / "refuse", chat_llama, long_rows(), overlong=Overlong.refuse)


def test_a_streamed_file_cuts_and_drops_alike(tmp_path, chat_llama):
    _, cut, _ = dpo_task(tmp_path / "cut", chat_llama, long_rows(), streaming=True, eval_documents=2)
    pairs = list(cut.train)
    assert len(pairs) == 8 and all(len(p[f"{side}_ids"]) <= 128 for p in pairs for side in ("chosen", "rejected"))
    _, dropped, _ = dpo_task(tmp_path / "drop", chat_llama, long_rows(), streaming=True, eval_documents=2,
                             overlong=Overlong.drop)
    assert [p["chosen_ids"] for p in dropped.train] == [p["chosen_ids"] for k, p in enumerate(pairs) if k != 1]


def test_the_new_keys_are_checked():
    for options, why in (({"max_prompt_length": 0}, "task.max_prompt_length must be at least 1"),
                         ({"max_prompt_length": 128, "block_size": 128}, "less than task.block_size=128")):
        cfg = DPOConfig(config="x", **options)
        cfg.data_files.train = "x.jsonl"
        with pytest.raises(ConfigError, match=why):
            cfg.check()
    allowed = DPOConfig(config="x", overlong=Overlong.drop, max_prompt_length=64)  # drop: refused before
    allowed.data_files.train = "x.jsonl"
    allowed.check()


def test_a_run_trains_on_a_pair_whose_prompt_is_ten_times_the_block(tmp_path, chat_llama):
    """``python -m app``: the pair trains with its prompt cut, the log's data line says so; with
    ``task.overlong=drop`` it is dropped and counted."""
    prefs = write_jsonl(tmp_path / "long.jsonl", long_rows() * 2)
    args = ("task=dpo", f"task.config={chat_llama}", f"task.data_files.train={prefs}", "task.block_size=128",
            f"task.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=2", "trainer.batch_size=4",
            "logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")
    cut = "train: 20 pairs of {} (conversations), 2 with their prompt cut (to half of task.block_size=128, keep_end)"
    dropped = "train: 18 pairs of {} (conversations), 2 dropped as longer than task.block_size=128 (task.overlong=drop)"
    for overlong, said in (("truncate", cut), ("drop", dropped)):
        run = tmp_path / overlong
        run_app(*args, f"task.overlong={overlong}", f"hydra.run.dir={run}", cwd=tmp_path, check=True, timeout=300)
        assert f"data: {said.format(prefs)}" in (run / "app.log").read_text()
        assert (run / "model" / "config.json").is_file()
