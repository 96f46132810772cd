"""The typed config: every option composes; bad input fails at compose or startup with one sentence."""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from app.config import ConfigError, HardwareKind, MonitorMode, PrecisionMode, RunConfig, Tracker
from app.launching.validate import validate
from app.tasks import TASK_SCHEMAS, CausalLMConfig, DigitsConfig
from tests.conftest import CONF_DIR, REPO, compose_config, compose_many, run_app

OPTIONS = {group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
           for group in ("task", "hardware", "precision", "optim", "scheduler")}


def test_defaults_are_the_documented_ones():
    cfg = compose_config()
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.task, DigitsConfig)
    assert cfg.hardware.kind is HardwareKind.cpu
    assert cfg.precision.mode is PrecisionMode.no
    assert cfg.optim._target_ == "torch.optim.AdamW"
    assert cfg.early_stopping.monitor == "eval/accuracy" and cfg.early_stopping.mode is MonitorMode.max
    assert cfg.logging.trackers == [Tracker.tensorboard]
    assert {"every_n_steps", "total_limit", "keep_best"} <= set(vars(cfg.checkpoint))


def test_every_option_combination_composes():
    """Every combination of the hardware, precision, optim and scheduler options, with the default task;
    every task option once (a task option sets its own keys and recipe, and nothing of the other groups'
    choice, so crossing it with them would only multiply the time)."""
    groups = {g: names for g, names in OPTIONS.items() if g != "task"}
    combos = list(itertools.product(*groups.values()))
    assert len(combos) >= 5 * 3 * 2 * 3
    configs = compose_many([[f"{g}={name}" for g, name in zip(groups, combo)] for combo in combos]
                           + [[f"task={task}"] for task in OPTIONS["task"]])
    for combo, cfg in zip(combos, configs):
        hardware, precision, optim, scheduler = combo
        assert cfg.hardware.kind.value == hardware
        assert cfg.precision.mode.value == precision
        assert cfg.optim._target_.lower().endswith(optim)
        assert cfg.scheduler._target_.endswith(f"{scheduler}_with_warmup")
    for task, cfg in zip(OPTIONS["task"], configs[len(combos):]):
        assert cfg.task.name == task
        # The language-model tasks train the steps asked for (issue 51): early stopping only when asked.
        language_model = isinstance(cfg.task, CausalLMConfig)
        assert (cfg.early_stopping.patience is None) == language_model, task
        # Each task option names a schema of ours (the GLUE presets: text_classification's).
        assert type(cfg.task) in TASK_SCHEMAS.values()
        assert type(cfg.task) is TASK_SCHEMAS["text_classification" if task.startswith("glue_") else task]


def test_experiment_option_composes():
    for path in (CONF_DIR / "experiment").glob("*.yaml"):
        compose_config(f"experiment={path.stem}")


def test_command_line_beats_task_recipe():
    assert compose_config().optim.lr == pytest.approx(3e-3)  # digits' recipe
    assert compose_config("optim.lr=1e-4").optim.lr == pytest.approx(1e-4)
    assert compose_config("task=glue_mrpc").optim.lr == pytest.approx(2e-5)
    assert compose_config("task=dpo", "early_stopping.patience=3").early_stopping.patience == 3


@pytest.mark.parametrize("override, error", [
    ("trainer.batchsize=3", ConfigKeyError),        # typo key
    ("trainer.batch_size=abc", ValidationError),     # wrong type
    ("early_stopping.mode=up", ValidationError),     # unknown enum value
    ("seed=1.5", ValidationError),
])
def test_schema_rejects_at_compose_time(override, error):
    with pytest.raises((error, ConfigCompositionException)):
        compose_config(override)


@pytest.mark.parametrize("override", ["task=nope", "hardware=tpu9", "precision=fp8"])
def test_unknown_option_is_rejected(override):
    with pytest.raises(ConfigCompositionException):
        compose_config(override)


@pytest.mark.parametrize("overrides, cuda, fragment", [
    (["precision=fp16"], 0, "precision=fp16 needs a CUDA GPU"),
    (["hardware=gpu"], 0, "needs a CUDA GPU"),
    (["trainer.batch_size=0"], 0, "trainer.batch_size must be positive"),
    (["optim.lr=-1"], 0, "optim.lr must be a positive number"),
    (["optim.lr=0"], 0, "optim.lr must be a positive number"),
    (["optim.layer_decay=0"], 0, "optim.layer_decay must be in (0, 1]"),
    (["optim.layer_decay=1.5"], 0, "optim.layer_decay must be in (0, 1]"),
    (["optim.freeze=['(']"], 0, "optim.freeze has '(', which is not a regular expression"),
    (["trainer.gradient_accumulation_steps=0"], 0, "gradient_accumulation_steps must be positive"),
    (["checkpoint.total_limit=0"], 0, "checkpoint.total_limit must be positive"),
    (["hardware.num_threads=0"], 0, "hardware.num_threads must be positive"),
    (["hardware=multi_cpu", "hardware.num_processes=1"], 0, "needs at least 2 processes"),
    (["hardware=fsdp", "hardware.num_processes=1"], 0, "needs at least 2 processes"),
    (["hardware=cpu", "hardware.num_processes=2"], 0, "runs one process"),
    (["hardware=multi_gpu", "hardware.num_processes=4"], 2, "more GPUs than the 2 visible"),
    (["trainer.max_epochs=0", "trainer.max_steps=-1"], 0, "max_epochs or trainer.max_steps"),
])
def test_cross_field_rules(overrides, cuda, fragment):
    cfg = compose_config(*overrides)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")) as info:
        validate(cfg, visible={"cuda": cuda})
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")


def test_valid_configs_pass_validation():
    validate(compose_config(), visible={"cuda": 0})
    validate(compose_config("hardware=multi_cpu", "hardware.num_processes=2"), visible={"cuda": 0})
    validate(compose_config("precision=fp16", "hardware=gpu"), visible={"cuda": 1})
    validate(compose_config("precision=bf16"), visible={"cuda": 0})


@pytest.mark.parametrize("args, fragment", [
    (["trainer.batchsize=3"], "batchsize"),
    (["trainer.batch_size=abc"], "batch_size"),
    (["task=nope"], "nope"),
    (["precision=fp16"], "precision=fp16 needs a CUDA GPU"),
    (["hardware=gpu"], "needs a CUDA GPU"),
    (["trainer.batch_size=0"], "trainer.batch_size must be positive"),
    (["optim.lr=-1"], "optim.lr must be a positive number"),
    (["trainer.group_by_length=true"], "trainer.group_by_length=true needs sample lengths"),
    (["optim.layer_decay=0.8"], "optim.layer_decay needs a model built of numbered blocks"),
    (["optim.freeze=[embeddings]"], "optim.freeze pattern 'embeddings' matches none of the model's parameters"),
])
def test_bad_input_exits_nonzero_and_leaves_nothing_behind(tmp_path, args, fragment):
    run_dir = tmp_path / "run"
    proc = run_app(f"hydra.run.dir={run_dir}", *args, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr
    # Not even Hydra's record of the composed config or the log: the run folder is gone.
    assert not run_dir.exists(), list(run_dir.rglob("*"))


def test_config_module_is_the_lowest_level():
    """app/config.py imports nothing from app (function-local imports included): the tasks' schemas and
    the hardware specs import it, and app/launching/validate.py puts the rules together."""
    tree = ast.parse((REPO / "app" / "config.py").read_text(encoding="utf-8"))
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert imported and not [name for name in imported if name == "app" or name.startswith("app.")]


def test_group_rules_refuse_before_torch_is_imported():
    """Each group's check(), the task schema's included, answers through validate without torch."""
    code = (
        "import sys\n"
        "from app.config import AdamWConfig, ConfigError, RunConfig, TrainerConfig\n"
        "from app.launching.validate import validate\n"
        "from app.tasks import DigitsConfig\n"
        "for cfg in (RunConfig(task=DigitsConfig(), optim=AdamWConfig(), trainer=TrainerConfig(batch_size=0)),\n"
        "            RunConfig(task=DigitsConfig(dropout=2.0), optim=AdamWConfig())):\n"
        "    try:\n"
        "        validate(cfg, visible={})\n"
        "    except ConfigError as e:\n"
        "        print(e)\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=True)
    assert proc.stdout.splitlines() == ["trainer.batch_size must be positive, got 0.",
                                        "task.dropout must be in [0, 1), got 2.0.", "False"]


def test_test_predictions_are_an_explicit_ability():
    from app.tasks.base import PredictsTest
    from app.tasks.digits.task import DigitsTask
    from app.tasks.text.task import TextClassificationTask

    glue = compose_config("task=glue_mrpc", "task.predict_test=true")
    assert glue.predicts_test and isinstance(TextClassificationTask(glue.task), PredictsTest)
    assert not compose_config("task=glue_mrpc").predicts_test
    digits = compose_config()
    assert not digits.predicts_test and not isinstance(DigitsTask(digits.task), PredictsTest)
