"""``task=causal_lm``: a causal language model on the user's text, packed or one document per row,
map-style or streamed (``task.streaming``), evaluated from token-loss sums reduced across processes.

In-process: packing (EOS between documents, blocks of block_size), the padded loss masked on the
padding, a stream's parts cover the file once and resume where they were saved, a streamed run
resumed from a mid-stream checkpoint ends with the uninterrupted run's weights. As a user runs it
(``python -m app``): perplexity falls, ``train/tokens_per_s`` is logged, the export loads with
``from_pretrained`` and generates; on 2 processes a streamed run SIGKILLed mid-run and resumed ends
bitwise equal to the uninterrupted one (and refuses to resume on another number of processes), and
its ``eval/loss`` is the one a plain loop computes.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from app.config import ConfigError
from app.tasks.causal_lm.batches import IGNORE_INDEX, LMCollator
from app.tasks.causal_lm.documents import encode_documents, pack
from app.tasks.causal_lm.stream import LineReader, LineStream
from tests.conftest import compose_config, compose_many, launch_app, run_app
from tests.helpers.tiny_llama import documents, make_tiny_llama, write_jsonl, write_text

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), hidden=16, layers=1, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def tokenizer(llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama)


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def eval_events(run: Path) -> list[dict]:
    return [e for e in events(run) if "eval/loss" in e]


def logged(run: Path) -> list[tuple]:
    """What must match between runs: every logged value except throughput."""
    return [tuple(sorted((k, v) for k, v in e.items() if not k.endswith("_per_s"))) for e in events(run)]


def plain_eval_loss(model_dir: Path, docs: list[str], block_size: int) -> tuple[float, int]:
    """The mean next-token loss over the packed blocks of ``docs``, by a plain Transformers loop, and
    the number of blocks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokens = [t for ids in tok(docs)["input_ids"] for t in [*ids, tok.eos_token_id]]
    blocks = torch.tensor(tokens[:len(tokens) // block_size * block_size]).view(-1, block_size)
    with torch.no_grad():
        losses = [model(input_ids=b[None], labels=b[None]).loss.double() * (block_size - 1) for b in blocks]
    return float(sum(losses) / (len(blocks) * (block_size - 1))), len(blocks)


# -- data: packing, padding, streams -------------------------------------------------------------------


def test_documents_end_with_eos_and_pack_into_blocks_carrying_the_rest(tokenizer):
    encoded = encode_documents(tokenizer, ["the cat chased the red ball .", "", "a dog found fresh bread ."])
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert len(encoded) == 2  # a blank line is no document
    assert all(ids[0] == bos and ids[-1] == eos and ids.count(eos) == 1 for ids in encoded)
    flat = [t for ids in encoded for t in ids]
    blocks, rest = pack([7, 8], encoded, 5)
    assert all(len(b) == 5 for b in blocks) and len(rest) < 5
    assert [t for b in blocks for t in b] + rest == [7, 8, *flat]


def test_single_documents_are_padded_and_the_loss_skips_the_padding(llama, tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama))
    docs = encode_documents(tokenizer, ["the cat chased the red ball in the rain .", "a dog found fresh bread ."])
    batch = LMCollator(pad_id=0)([{"input_ids": ids} for ids in docs])
    short = len(docs[1])
    assert batch["input_ids"].shape == (2, len(docs[0]))
    assert batch["attention_mask"][1].tolist() == [1] * short + [0] * (len(docs[0]) - short)
    assert (batch["labels"][1, short:] == IGNORE_INDEX).all()
    with torch.no_grad():
        padded = model(**batch).loss
        sums = [model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss * (len(ids) - 1) for ids in docs]
    assert torch.allclose(padded, sum(sums) / sum(len(ids) - 1 for ids in docs), atol=1e-5)
    # Fixed shapes (XLA): padded to the block size whatever the batch's longest row.
    assert LMCollator(pad_id=0, fixed_length=32)([{"input_ids": ids} for ids in docs])["input_ids"].shape == (2, 32)


def test_text_jsonl_parquet_and_a_load_dataset_folder_give_the_same_blocks(tmp_path, llama, tokenizer):
    """The same documents as a text file, JSON Lines, parquet and a folder for datasets.load_dataset
    (task.dataset): the same packed training blocks; the validation split is what evaluates."""
    import datasets

    from app.tasks.causal_lm.config import CausalLMConfig, LMDataFiles
    from app.tasks.causal_lm.task import CausalLMTask
    from tests.helpers.tiny_bert import FakeRuntime

    train, validation = documents(120, seed=7), documents(20, seed=8)
    folder = tmp_path / "hub_like"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "validation.jsonl", validation)
    for split, docs in (("train", train), ("validation", validation)):
        datasets.Dataset.from_dict({"body": docs}).to_parquet(str(tmp_path / f"{split}.parquet"))
    sources = {"text": {"data_files": LMDataFiles(str(write_text(tmp_path / "train.txt", train)),
                                                  str(write_text(tmp_path / "validation.txt", validation)))},
               "jsonl": {"data_files": LMDataFiles(str(folder / "train.jsonl"), str(folder / "validation.jsonl"))},
               "parquet": {"data_files": LMDataFiles(str(tmp_path / "train.parquet"), str(tmp_path / "validation.parquet")),
                           "text_field": "body"},
               "load_dataset": {"dataset": str(folder)}}
    blocks = {}
    for name, source in sources.items():
        cfg = CausalLMConfig(config=str(llama), block_size=16, cache_dir=str(tmp_path / "cache" / name), **source)
        data = CausalLMTask(cfg).build_data(FakeRuntime())
        blocks[name] = (data.train["input_ids"], data.eval["input_ids"])
    expected = [t for ids in encode_documents(tokenizer, train) for t in ids]
    assert blocks["text"][0] == [expected[i:i + 16] for i in range(0, len(expected) // 16 * 16, 16)]
    assert blocks["jsonl"] == blocks["text"] == blocks["load_dataset"] == blocks["parquet"]


def stream(path: Path, tokenizer, packing: bool, begin: int = 0) -> LineStream:
    return LineStream(path, begin, LineReader(path, "text"), functools.partial(encode_documents, tokenizer), 16,
                      packing)


def test_stream_parts_cover_the_file_once_and_resume_where_saved(tmp_path, tokenizer):
    docs = documents(300, seed=3)
    path = write_jsonl(tmp_path / "train.jsonl", docs)
    whole = [row["input_ids"] for row in stream(path, tokenizer, packing=False)]
    for count in (2, 3):
        parts = []
        for index in range(count):
            part = stream(path, tokenizer, packing=False)
            part.set_shard(index, count)
            parts.append([row["input_ids"] for row in part])
        assert [ids for p in parts for ids in p] == whole  # no duplicate, no gap, in file order
        assert min(len(p) for p in parts) > 0.8 * len(whole) / count

    reference = stream(path, tokenizer, packing=True)
    reference.set_shard(1, 2)
    blocks = [row["input_ids"] for row in reference]
    interrupted = stream(path, tokenizer, packing=True)
    interrupted.set_shard(1, 2)
    items = iter(interrupted)
    head = [next(items)["input_ids"] for _ in range(37)]  # mid-read: blocks waiting and a packing buffer
    saved = json.loads(json.dumps(interrupted.state_dict()))  # as a checkpoint stores it
    assert saved["pending"] and saved["carry"]
    resumed = stream(path, tokenizer, packing=True)
    resumed.set_shard(1, 2)
    resumed.load_state_dict(saved)
    assert head + [row["input_ids"] for row in resumed] == blocks

    other_part = stream(path, tokenizer, packing=True)
    with pytest.raises(ValueError, match="part 1 of 2"):
        other_part.load_state_dict(saved)
    path.write_text(path.read_text() + '{"text": "a dog found fresh bread ."}\n')
    with pytest.raises(ConfigError, match="has changed"):
        stream(path, tokenizer, packing=True).load_state_dict(saved)


def test_streaming_needs_max_steps_and_a_file_read_line_by_line():
    base = ("task=causal_lm", "task.config=llama", "task.data_files.train=corpus.jsonl", "task.streaming=true")
    refused = {"trainer.max_steps": base,
               "line by line": (*base[:2], "task.data_files.train=corpus.parquet", "task.streaming=true",
                                "trainer.max_steps=5"),
               "num_workers": (*base, "trainer.max_steps=5", "trainer.num_workers=2"),
               "not both": (*base, "trainer.max_steps=5", "task.model=llama")}
    for fragment, cfg in zip(refused, compose_many([list(o) for o in refused.values()]), strict=True):
        with pytest.raises(ConfigError, match=fragment):
            cfg.check()


def test_a_streamed_run_resumed_mid_stream_ends_with_the_uninterrupted_weights(tmp_path, llama):
    """One process, in-process: the run's checkpoint at step 3 (4 blocks of each 64-document read
    still waiting, a partial block in the buffer) resumed to the end gives the same final weights."""
    from app.distributed.checkpoint.store import complete_checkpoints
    from app.engine.run import run

    write_jsonl(tmp_path / "train.jsonl", documents(400, seed=1))
    args = ("task=causal_lm", f"task.config={llama}", f"task.data_files.train={tmp_path / 'train.jsonl'}",
            "task.streaming=true", "task.eval_documents=20", "task.block_size=16", "trainer.batch_size=4",
            "trainer.max_steps=6", "checkpoint.every_n_steps=3", "checkpoint.export=last",
            f"task.cache_dir={tmp_path / 'cache'}", "trainer.log_every_n_steps=2", *QUIET)
    reference = tmp_path / "reference"
    run(compose_config(*args), reference)
    kept = complete_checkpoints(reference / "checkpoints")
    assert [m.step for _, m in kept] == [3, 6]
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "checkpoints" / Path(kept[-1][0]).name)
    shutil.rmtree(resumed / "model")
    run(compose_config(*args, f"resume={resumed}"), resumed)
    weights = "model/model.safetensors"
    assert (resumed / weights).read_bytes() == (reference / weights).read_bytes()


# -- as a user runs it ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trains_with_falling_perplexity_and_exports_a_model_that_generates(tmp_path, llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_text(tmp_path / "corpus.txt", documents(600, seed=0))
    run_app("task=causal_lm", f"task.config={llama}", "task.data_files.train=corpus.txt", "task.block_size=32",
            "trainer.batch_size=8", "trainer.max_steps=24", "trainer.eval_every_n_steps=4", "trainer.log_every_n_steps=4",
            "optim.lr=1e-2", "checkpoint.export=last", "hydra.run.dir=run", "task.cache_dir=cache", *QUIET,
            cwd=tmp_path, check=True)
    run = tmp_path / "run"
    evaluated = eval_events(run)
    assert evaluated[0]["step"] == 4 and evaluated[-1]["step"] == 24
    assert evaluated[-1]["eval/perplexity"] < 0.8 * evaluated[0]["eval/perplexity"]
    assert all(math.isclose(e["eval/perplexity"], math.exp(e["eval/loss"])) for e in evaluated)
    logged = [e for e in events(run) if "train/loss" in e]
    assert len(logged) == 6 and all(e["train/tokens_per_s"] > 0 for e in logged)

    model = AutoModelForCausalLM.from_pretrained(run / "model")
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    prompt = tokenizer("the cat", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert "<unk>" not in tokenizer.decode(generated[0])


# -- as docs/tasks.md writes it (issue 42) --------------------------------------------------------------


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory, llama) -> Path:
    """``task=causal_lm`` from a config folder with docs/tasks.md's form of ``task.config_overrides``, and
    ``trainer.max_steps=37`` past the recipe's one epoch (13 optimizer steps of this corpus). The folder's
    config.json was made apart from its tokenizer: its BOS and EOS ids (0) are not the tokenizer's."""
    cwd = tmp_path_factory.mktemp("readme")
    folder = shutil.copytree(llama, cwd / "my_lm")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "bos_token_id": 0, "eos_token_id": 0}))
    write_text(cwd / "corpus.txt", documents(150, seed=0))
    run_app("task=causal_lm", "task.config=my_lm", "task.config_overrides={hidden_size: 48}",
            "task.data_files.train=corpus.txt", "task.block_size=32", "trainer.max_steps=37", "hydra.run.dir=run",
            "task.cache_dir=cache", *QUIET, cwd=cwd, check=True)
    return cwd / "run"


@pytest.mark.timeout(240)
def test_config_overrides_written_as_the_readme_does_build_the_model(readme_run):
    from safetensors import safe_open

    assert json.loads((readme_run / "model" / "config.json").read_text())["hidden_size"] == 48
    with safe_open(readme_run / "model" / "model.safetensors", "pt") as weights:
        assert weights.get_slice("model.embed_tokens.weight").get_shape()[1] == 48


@pytest.mark.timeout(240)
def test_a_new_models_special_tokens_are_its_tokenizers_and_the_log_says_so(readme_run, tokenizer):
    from transformers import AutoModelForCausalLM

    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    assert (eos, bos) == (2, 1)
    exported = json.loads((readme_run / "model" / "config.json").read_text())
    generation = json.loads((readme_run / "model" / "generation_config.json").read_text())
    assert (exported["eos_token_id"], exported["bos_token_id"], generation["eos_token_id"]) == (eos, bos, eos)
    assert AutoModelForCausalLM.from_pretrained(readme_run / "model").generation_config.eos_token_id == eos
    assert ("the model's special tokens follow its tokenizer's: eos_token_id 0 -> 2 (</s>), bos_token_id 0 -> 1 (<s>)"
            in (readme_run / "app.log").read_text())


@pytest.mark.timeout(200)
def test_a_tokenizer_without_eos_takes_the_models_or_is_refused_where_documents_are_packed(tmp_path, llama, caplog):
    """A tokenizer without an EOS whose model configuration names one uses that one (every LM task: the
    causal_lm run trains and exports it, sft's tokenizer has it), said once in the log; when the
    configuration names none either, packing is refused in one sentence."""
    from transformers import AutoTokenizer

    from app.tasks.sft.config import SFTConfig
    from app.tasks.sft.task import SFTTask

    tokenizer = AutoTokenizer.from_pretrained(llama)
    eos = tokenizer.eos_token
    tokenizer.eos_token = None
    folders = {}
    for name in ("config_eos", "no_eos"):
        folders[name] = shutil.copytree(llama, tmp_path / name)
        tokenizer.save_pretrained(folders[name])
        assert AutoTokenizer.from_pretrained(folders[name]).eos_token is None
    config = json.loads((folders["no_eos"] / "config.json").read_text())
    (folders["no_eos"] / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    write_text(tmp_path / "corpus.txt", documents(20))
    run = tmp_path / "run"
    run_app("task=causal_lm", "task.config=config_eos", "task.data_files.train=corpus.txt", f"hydra.run.dir={run}",
            "task.block_size=32", "trainer.max_steps=2", *QUIET, cwd=tmp_path, timeout=100, check=True)
    said = (f"the tokenizer of config_eos has no EOS token; the model's configuration names {eos} "
            f"(id {config['eos_token_id']}): using it as EOS")
    assert (run / "app.log").read_text().count(said) == 1
    assert AutoTokenizer.from_pretrained(run / "model").eos_token == eos
    sft = SFTConfig(config=str(folders["config_eos"]))
    sft.data_files.train = "chat.jsonl"
    with caplog.at_level("INFO"):
        task = SFTTask(sft)
        assert task.tokenizer.eos_token == eos and task.tokenizer.eos_token_id == config["eos_token_id"]
        assert task.tokenizer is task.tokenizer
    assert sum("using it as EOS" in record.getMessage() for record in caplog.records) == 1
    proc = run_app("task=causal_lm", "task.config=no_eos", "task.data_files.train=corpus.txt", "hydra.run.dir=refused",
                   *QUIET, cwd=tmp_path, timeout=100)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: the tokenizer of no_eos has no EOS token, so packed documents would run into each other"), proc.stderr
    assert not (tmp_path / "refused").exists()


def test_the_docs_config_folder_recipe_makes_a_folder_the_task_builds_from(tmp_path, llama, monkeypatch):
    from app.tasks.causal_lm.task import CausalLMTask
    from tests.conftest import REPO

    readme = (REPO / "docs" / "tasks.md").read_text()
    recipe = readme.split("A `task.config` folder is a model configuration", 1)[1].split("```python\n", 1)[1]
    recipe = recipe.split("```", 1)[0].replace("<tokenizer folder or hub name>", str(llama))
    monkeypatch.chdir(tmp_path)
    exec(compile(recipe, "docs/tasks.md", "exec"), {})  # noqa: S102 - the page's own code, as a user runs it
    task = CausalLMTask(compose_config("task=causal_lm", "task.config=my_lm", "task.data_files.train=x.txt").task)
    model = task.build_model()
    assert model.config.hidden_size == 256 and model.config.num_hidden_layers == 4
    assert model.config.eos_token_id == task.tokenizer.eos_token_id == 2


def test_a_free_key_dict_takes_keys_in_every_form_and_other_keys_stay_checked(llama):
    for form in (["task.config_overrides={hidden_size: 48, num_hidden_layers: 1}"],
                 ["task.config_overrides.hidden_size=48", "+task.config_overrides.num_hidden_layers=1"]):
        cfg = compose_config("task=causal_lm", f"task.config={llama}", "task.data_files.train=x.txt", *form)
        assert cfg.task.config_overrides == {"hidden_size": 48, "num_hidden_layers": 1}, form
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="task.block_sze"):
        compose_config("task=causal_lm", f"task.config={llama}", "task.block_sze=3")


@pytest.mark.timeout(240)
def test_max_steps_given_alone_trains_past_the_recipes_epoch_and_the_stop_names_it(readme_run):
    result = json.loads((readme_run / "result.json").read_text())
    assert (result["steps"], result["stop_reason"]) == (37, "reached trainer.max_steps (37 optimizer steps)")
    assert [e["step"] for e in eval_events(readme_run)] == [13, 26, 37]  # epochs of 13 steps, then the end
    assert "ends training" not in (readme_run / "app.log").read_text()  # one limit: nothing to weigh


@pytest.mark.timeout(240)
def test_the_last_steps_training_loss_is_logged_though_no_log_step_falls_on_them(readme_run):
    # log_every_n_steps is 10 (the default): steps 31-37 make the run's last line, logged at step 37
    # before that step's evaluation, and its loss is the mean over those steps' tokens.
    train = [(e["step"], e["epoch"]) for e in events(readme_run) if "train/loss" in e]
    assert train == [(10, 0), (20, 1), (30, 2), (37, 2)]
    last = [i for i, e in enumerate(events(readme_run)) if e["step"] == 37]
    assert ["train/loss" in events(readme_run)[i] for i in last] == [True, False]
    assert math.isfinite(events(readme_run)[last[0]]["train/loss"])


def test_the_log_says_what_the_run_learnt_from(readme_run):
    # 135 documents train, 15 held out (10 %); blocks of 32 tokens, 8 a batch: the 13 steps of an epoch.
    assert re.search(r"data: train: 135 documents of corpus\.txt -> (\d+) blocks of 32 tokens \(([\d,]+) tokens\); "
                     r"evaluation: 15 documents of corpus\.txt \(held out\) -> (\d+) blocks of 32 tokens",
                     (readme_run / "app.log").read_text())
    found = re.search(r"-> (\d+) blocks of 32 tokens \(([\d,]+) tokens\)", (readme_run / "app.log").read_text())
    blocks = int(found.group(1))
    assert math.ceil(blocks / 8) == 13 and int(found.group(2).replace(",", "")) == 32 * blocks


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_streamed_on_two_processes_killed_and_resumed_ends_bitwise_equal(tmp_path, llama):
    """Two processes each read their half of the stream; rank 0 SIGKILLs itself half-way through the
    second save (step 6); resumed from step 3, the run ends with the uninterrupted run's weights and logged losses. The
    evaluation (its blocks do not fill the last global batch of 2 x 4: duplicates complete it) is the
    loss a plain loop computes on the exported model."""
    from app.distributed.checkpoint.store import FAULT_ENV

    write_jsonl(tmp_path / "train.jsonl", documents(600, seed=2))
    validation = documents(60, seed=5)
    write_text(tmp_path / "validation.txt", validation)
    args = ("task=causal_lm", f"task.config={llama}", f"task.data_files.train={tmp_path / 'train.jsonl'}",
            f"task.data_files.validation={tmp_path / 'validation.txt'}", "task.streaming=true", "task.block_size=16",
            "trainer.batch_size=4", "trainer.eval_batch_size=4", "trainer.max_steps=9", "checkpoint.every_n_steps=3",
            "trainer.eval_every_n_steps=9", "trainer.log_every_n_steps=2", "checkpoint.export=last",
            "hardware=multi_cpu", "hardware.num_processes=2", f"task.cache_dir={tmp_path / 'cache'}", *QUIET)
    reference, run = tmp_path / "reference", tmp_path / "run"
    launch_app(*args, run_dir=reference)  # the uninterrupted run: the command line is the killed one's
    proc = run_app(*args, f"hydra.run.dir={run}", cwd=tmp_path, env={FAULT_ENV: "files:1"})
    assert proc.returncode != 0
    run_app(f"resume={run}", cwd=tmp_path, check=True)
    weights = "model/model.safetensors"
    assert (run / weights).read_bytes() == (reference / weights).read_bytes()
    assert logged(run) == logged(reference)
    # Each process's position is in its own part of the stream: another number of processes is refused.
    proc = run_app(f"resume={run}", "hardware=cpu", "trainer.max_steps=12", cwd=tmp_path)
    assert proc.returncode == 2 and "resumes on 2 process(es) only, not 1." in proc.stderr.strip().splitlines()[-1]

    final = eval_events(reference)[-1]
    loss, blocks = plain_eval_loss(reference / "model", validation, 16)
    assert blocks % 8 and final["eval/num_samples"] == blocks
    assert math.isclose(final["eval/loss"], loss, rel_tol=1e-5)
