"""Every key a task lists in ``--help`` is one it uses (issue 51): ``task=sft`` is ``task=causal_lm`` plus
its keys, and ``task=dpo``, ``task=kto`` and ``task=reward_model`` are ``task=sft`` plus the preference tasks'
keys and their own, so a task inherits keys it may have no use for (``task=dpo task.sample_prompts=2`` once
wrote nothing and said nothing). Such a key is in the schema's ``UNUSED``: ``--help`` leaves it out, and a
value other than its default is refused in one sentence.

The language-model tasks are run in this process, short (2 steps, an evaluation, a checkpoint, the export),
with their config recording which keys the task's own code reads (``app/tasks/``, its schema's checks
aside), on each path a key can matter on: files, map-style or streamed (with ``task.eval_documents``), and
a ``task.dataset`` folder. Every key ``--help`` lists must have been read. ``task=digits`` and
``task=text_classification`` inherit no task's keys."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from app.cli.help import run_keys
from app.config import TaskConfig
from app.engine.run import run
from app.tasks import TASK_SCHEMAS
from tests.conftest import CONF_DIR, compose_config, run_app
from tests.helpers.dpo_pairs import kto_rows, preference_rows
from tests.helpers.tiny_chat import conversations, make_tiny_chat_llama, write_jsonl
from tests.helpers.tiny_llama import documents, write_text

SHORT = ("trainer.max_steps=2", "trainer.eval_every_n_steps=2", "logging.trackers=[]", "logging.progress_bar=false",
         "task.block_size=64")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("task_keys")
    make_tiny_chat_llama(folder / "base", hidden=16, layers=1)
    write_text(folder / "docs.txt", documents(60))
    write_jsonl(folder / "chat.jsonl", [{"messages": c} for c in conversations(40)])
    write_jsonl(folder / "prefs.jsonl", preference_rows(40))
    write_jsonl(folder / "feedback.jsonl", kto_rows(40))
    write_jsonl(folder / "prompts.jsonl", [{"prompt": c[:1], "answer": "the"} for c in conversations(40)])
    for name, source in (("docs", "docs.txt"), ("chat", "chat.jsonl"), ("prefs", "prefs.jsonl"),
                         ("feedback", "feedback.jsonl"), ("prompts", "prompts.jsonl")):
        (folder / f"{name}_dataset").mkdir()  # a task.dataset folder: datasets.load_dataset reads its file
        (folder / f"{name}_dataset" / f"train{Path(source).suffix}").write_bytes((folder / source).read_bytes())
    return folder


GRPO = ("task.rewards=[{_target_: tests.helpers.grpo_rewards.word_share}]", "task.num_generations=2",
        "task.max_completion_length=4", "trainer.batch_size=2")


def probes(task: str, data: Path) -> list[list[str]]:
    """The command lines that take ``task`` down each path a key of it can matter on."""
    source = {"causal_lm": "docs", "sft": "chat", "dpo": "prefs", "kto": "feedback", "grpo": "prompts",
              "reward_model": "prefs"}[task]
    file = data / ("docs.txt" if task == "causal_lm" else f"{source}.jsonl")
    common = [f"task={task}", f"task.config={data / 'base'}", *SHORT, *(GRPO if task == "grpo" else ())]
    extra = {"sft": ["task.sample_prompts=1"], "dpo": ["task.reference=precomputed"],
             "kto": ["task.reference=precomputed"], "reward_model": ["task.predict_test=true"]}.get(task, [])
    paths = [[*common, *extra, f"task.data_files.train={file}"],
             [*common, *extra, f"task.dataset={data / f'{source}_dataset'}"]]
    if task != "grpo":  # task=grpo reads its prompts whole (streaming refused)
        paths.append([*common, *extra, f"task.data_files.train={file}", "task.streaming=true",
                      "task.eval_documents=5",
                      "task.packing=false" if task in ("dpo", "kto", "reward_model") else "task.packing=true"])
    if task in ("dpo", "kto"):  # TR-DPO's reference moving towards the policy: a copy's (precomputed ones do not move)
        paths.append([*common, f"task.data_files.train={file}", "task.sync_ref_every=1"])
    if task == "grpo":  # a KL term to the reference
        paths.append([*common, f"task.data_files.train={file}", "task.beta=0.04"])
    return paths


def recording(cfg: TaskConfig, read: set[str]) -> TaskConfig:
    """``cfg`` as an instance of a subclass of its schema that adds to ``read`` each field the task's own
    code reads (a caller in ``app.tasks``, not a schema's checks, which read every field)."""
    names = {f.name for f in dataclasses.fields(cfg)}

    def __getattribute__(self: Any, name: str) -> Any:
        if name in names:
            frame = sys._getframe(1)
            caller = frame.f_globals.get("__name__", "")
            # A schema's checks read every field, also through its other methods (the preference tasks'
            # reference_mode); those methods called from the task's code (dpo's objectives()) serve it.
            checking, outer = False, frame
            while outer is not None and not checking:
                if outer.f_code is not __getattribute__.__code__:  # a property read through this recorder
                    if not outer.f_globals.get("__name__", "").endswith(".config"):
                        break
                    checking = outer.f_code.co_name.startswith(("check", "__"))
                outer = outer.f_back
            if caller.startswith("app.tasks.") and not checking:
                read.add(name)
        return object.__getattribute__(self, name)

    schema = type(cfg)
    recorder = type(schema.__name__, (schema,), {"__getattribute__": __getattribute__})
    copy = recorder.__new__(recorder)
    for f in dataclasses.fields(cfg):
        object.__setattr__(copy, f.name, getattr(cfg, f.name))
    return copy


@pytest.mark.timeout(240)
@pytest.mark.parametrize("task", ["causal_lm", "sft", "dpo", "kto", "grpo", "reward_model"])
def test_help_lists_only_the_keys_the_task_reads(task, data, tmp_path):
    read: set[str] = set()
    for number, overrides in enumerate(probes(task, data)):
        cfg = compose_config(*overrides, f"task.cache_dir={tmp_path / 'cache'}")
        cfg.task = recording(cfg.task, read)
        (tmp_path / str(number)).mkdir()
        run(cfg, tmp_path / str(number))
    schema = TASK_SCHEMAS[task]
    listed = {key.removeprefix("task.").split(".")[0] for key in run_keys(CONF_DIR, {"task": task})
              if key.startswith("task.")}
    assert listed == {f.name for f in dataclasses.fields(schema)} - set(schema.UNUSED) - {"name"}
    assert sorted(listed - read) == [], f"task={task}'s --help lists keys it never reads"
    assert not set(schema.UNUSED) & read, f"a key marked unused is read: {sorted(set(schema.UNUSED) & read)}"


def test_the_other_tasks_inherit_no_tasks_keys():
    for name in ("digits", "text_classification"):
        assert TASK_SCHEMAS[name].__bases__ == (TaskConfig,) and not TASK_SCHEMAS[name].UNUSED, name


def test_a_key_the_task_does_not_use_is_refused_in_one_sentence(tmp_path):
    """As typed: ``task=dpo task.sample_prompts=2`` (checked before anything is read or built)."""
    proc = run_app("task=dpo", "task.config=base", "task.data_files.train=prefs.jsonl", "task.sample_prompts=2",
                   "hydra.run.dir=run", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and not (tmp_path / "run").exists(), proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: task.sample_prompts=2 does not apply to task=dpo: it generates no samples at evaluation yet "
        "(task.sample_prompts is task=sft's).")
    for key, value in (("loss_chunk", "0"), ("completion_field", "answer"), ("train_on", "all"), ("format", "text")):
        cfg = compose_config("task=dpo", "task.config=base", "task.data_files.train=prefs.jsonl", f"task.{key}={value}")
        with pytest.raises(Exception, match=rf"^task\.{key}={value} does not apply to task=dpo: "):
            cfg.check()
