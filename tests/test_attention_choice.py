"""``task.attn_implementation``: the model is built with the attention asked for (its packed rows then run
that attention's packed-sequence path); an implementation that cannot run here (flash-attn not installed,
no CUDA GPU) and an unknown name stop with one sentence."""

from __future__ import annotations

import pytest

from app.config import ConfigError
from app.tasks.sft.config import SFTConfig
from app.tasks.sft.task import SFTTask
from tests.helpers.tiny_chat import make_tiny_chat_llama


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_chat_llama(tmp_path_factory.mktemp("attention") / "base")


def built(folder, attention):
    cfg = SFTConfig(config=str(folder), attn_implementation=attention)
    cfg.data_files.train = "x.jsonl"
    cfg.check()
    return SFTTask(cfg).build_model()


def test_the_model_runs_the_attention_asked_for(folder):
    assert built(folder, "eager").config._attn_implementation == "eager"
    assert built(folder, None).config._attn_implementation == "sdpa"  # Transformers' choice


def test_an_attention_that_cannot_run_here_is_one_sentence(folder):
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash-attn is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="^task.attn_implementation=flash_attention_2 cannot be used here: "):
        built(folder, "flash_attention_2")


def test_an_unknown_attention_is_refused():
    with pytest.raises(ConfigError, match="task.attn_implementation=flash is none of eager, sdpa"):
        built("x", "flash")
