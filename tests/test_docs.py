"""The docs cannot go stale: what README.md, docs/*.md and bench/README.md tell a user to type, link to
or open is checked against the code.

- Every ``python -m app …`` (and ``torchrun … -m app …``) command in a shell code block is composed as
  the entry composes it: the command line's rewrites before Hydra (``--config-dir``, a sweep over tasks,
  ``resume=<path>``), Hydra's composition against the schemas (a renamed key or option fails here), the
  conversion to dataclasses, keys added past the schema with ``+``, the groups' own rules (``check()``)
  and the launcher layout rule (``torchrun``'s and ``srun``'s process counts against the config's). A
  multirun (``-m``) composes every job of its grid. Placeholders (``<model>``, ``outputs/<date>/<time>``,
  ``checkpoint_<N>``...) are filled with real things: folders made for the test and a real run folder,
  trained for 2 steps once per module, for ``resume=`` and ``mode=eval`` to read. A hardware kind's
  rules on this machine's devices (``hardware=gpu`` without CUDA) are not applied: the docs describe
  other machines (``tests/test_hardware.py`` tests those rules). ``--help`` commands build the help.
- Every relative link leads to a file that exists, and to a heading of it when it names an anchor.
- Every repository path the pages name (``app/engine/loop.py``, ``conf/task/``, ``python bench/x.py``)
  exists; paths inside a run folder (``model/export.json``) or on the user's side (``outputs/...``,
  ``<...>``) are not the repository's.

Composition runs in this process, through the same functions ``python -m app`` calls (a subprocess per
command would cost ~0.4 s of interpreter start each, and ``--cfg job`` applies neither the groups' rules
nor the ``+key`` check)."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONF_DIR, REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
SHELL_BLOCKS = ("bash", "sh", "shell", "console", "")
QUIET = ("logging.progress_bar=false", "logging.print_config=false", "logging.trackers=[]")


# -- reading the pages --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the first line inside the fence
    lang: str
    lines: tuple[str, ...]


def code_blocks(path: Path) -> list[Block]:
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), number + 1, []
            else:
                blocks.append(Block(path, start, lang, tuple(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def prose(path: Path) -> str:
    """The page without its code blocks (so a ``#`` comment in a block is no heading, nor its spans paths)."""
    out, inside = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        out.append("" if inside else line)
    return "\n".join(out)


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """The block's lines with backslash continuations joined, each with its line number in the page."""
    out: list[tuple[int, str]] = []
    pending, first = "", 0
    for offset, line in enumerate(block.lines):
        if not pending:
            first = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    if pending:
        out.append((first, pending))
    return out


APP = re.compile(r"(?:\bpython3? -m app|\btorchrun\b(?P<torchrun>.*?) -m app)(?=\s|$)")


@dataclasses.dataclass(frozen=True)
class DocCommand:
    where: str  # docs/x.md:LINE
    text: str  # the arguments after ``-m app``, placeholders still in
    cwd: str  # relative to the repository (a ``cd`` earlier in the block)
    launched: tuple[int, int] | None  # (WORLD_SIZE, LOCAL_WORLD_SIZE) of torchrun or srun, else None


def doc_commands() -> list[DocCommand]:
    commands = []
    for path in DOCS:
        for block in code_blocks(path):
            if block.lang not in SHELL_BLOCKS:
                continue
            cwd, sbatch = ".", {}
            for number, line in logical_lines(block):
                if line.startswith("#SBATCH"):
                    sbatch.update(re.findall(r"--([\w-]+)=(\S+)", line))
                if line.startswith("cd "):
                    cwd = line.split("&&")[0].split()[1]
                match = APP.search(line)
                if match is None:
                    continue
                launched = None
                if match.group("torchrun") is not None:
                    options = dict(re.findall(r"--([\w-]+)[= ](\S+)", match.group("torchrun")))
                    local = int(options.get("nproc_per_node", options.get("nproc-per-node", 1)))
                    launched = (int(options.get("nnodes", 1)) * local, local)
                elif line.lstrip().startswith("srun ") and sbatch:
                    local = int(sbatch["ntasks-per-node"])
                    launched = (int(sbatch["nodes"]) * local, local)
                rest = re.split(r"\s(?:&&|;|\|)\s", line[match.end():])[0]
                commands.append(DocCommand(f"{path.relative_to(REPO)}:{number}", rest, cwd, launched))
    return commands


COMMANDS = doc_commands()


def test_the_readme_is_a_front_door():
    """At most ~300 lines: what it is, the two commands, a tour, where outputs and code live; topics are
    pages of docs/, benchmark results bench/README.md."""
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_the_pages_have_their_commands():
    """The extraction itself: a broken fence or pattern would otherwise leave nothing to check."""
    pages = {c.where.split(":")[0] for c in COMMANDS}
    assert {"README.md", "docs/configuration.md", "docs/tasks.md", "docs/sweeps.md", "docs/checkpoints.md",
            "docs/hardware.md", "docs/slurm.md", "docs/tpu.md", "bench/README.md"} <= pages, pages
    assert len(COMMANDS) >= 60, len(COMMANDS)


# -- placeholders, filled with real things -----------------------------------------------------------


def train(cwd: Path, run_dir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "app", *args, "trainer.max_steps=2", *QUIET,
                             f"hydra.run.dir={run_dir}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, Path]:
    """A real 2-step run of the default job (``outputs/2026-11-29/13-13-57``, the name the docs show) and
    one of the tabular example from its own folder, both with a checkpoint and an export, trained side by
    side; folders for the models, data and config folders the docs leave to the user."""
    root = tmp_path_factory.mktemp("docs")
    digits = root / "outputs" / "2026-11-29" / "13-13-57"
    tabular = root / "tabular" / "outputs" / "2026-11-29" / "13-13-57"
    runs = [train(root, digits), train(REPO / "examples" / "tabular", tabular, "--config-dir", "conf", "task=tabular")]
    for proc in runs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    folders = {name: root / name for name in ("model", "data", "config", "work")}
    for folder in folders.values():
        folder.mkdir()
    return {"digits": digits, "tabular": tabular, **folders}


def fill(command: DocCommand, fx: dict[str, Path]) -> str:
    """The command with every placeholder replaced; an unknown one fails, naming itself."""
    run = fx["tabular"] if command.cwd == "examples/tabular" else fx["digits"]
    checkpoint = next((run / "checkpoints").glob("checkpoint_*"))
    text = command.text
    for pattern, value in [
        (r"\$\(python -c '[^']*'\)|\$\(python -c \"[^\"]*\"\)", fx["model"]),  # task.model=$(python -c "...")
        (r"\$SLURM_JOB_ID", "57"),
        (r"outputs/multirun/<date>/<time>", fx["work"] / "multirun"),
        (r"outputs/(?:<date>/<time>|2026-11-29/13-13-57|\.\.\.)", run),
        (r"checkpoint_<N>", checkpoint.name),
        (r"<checkpoint>", checkpoint),
        (r"<(?:model|model folder|model folder or hub name|folder or hub name|base model|sft model|MiniLM|MiniLM folder|all-MiniLM-L6-v2 folder)>",
         fx["model"]),
        (r"<(?:GLUE MRPC folder|GLUE MRPC|folder|glue_data)>", fx["data"]),
        (r"<(?:config folder|hub name or folder)>", fx["config"]),
        (r"<partition>", "debug"),
    ]:
        text = re.sub(pattern, lambda _m, v=str(value): v, text)
    leftover = re.findall(r"<[^<>]*>|\.\.\.|…", text.split("#")[0])
    assert not leftover, f"{command.where}: fill the placeholder {leftover[0]} in tests/test_docs.py"
    return text


# -- composing, as the entry does ---------------------------------------------------------------------


def entry_argv(argv: list[str]) -> list[str]:
    """The command line as ``python -m app`` rewrites it before Hydra (the first steps of ``app.cli.argv.STEPS``): the config
    folder as a search path, a list key's bare value, a task sweep's task keys, ``resume=<path>``'s run folder and overrides.
    (torchrun's agreement on a run folder needs the running ranks; SLURM's layout, the environment.)"""
    from app.cli.argv import (
        argv_for_resume,
        bare_values_as_lists,
        config_dir_as_searchpath,
        task_keys_of_a_task_sweep,
    )

    return argv_for_resume(task_keys_of_a_task_sweep(bare_values_as_lists(config_dir_as_searchpath(argv))))


def jobs_of(overrides: list[str], multirun: bool) -> list[list[str]]:
    """One override list, or every job of a multirun's grid as Hydra's basic sweeper splits it (an Optuna
    search's space lives in its config: its jobs are the command's overrides with sampled values)."""
    if not multirun:
        return [overrides]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def compose_checked(overrides: list[str], launched: tuple[int, int] | None) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from app.cli.configure import limits_as_given, to_run_config
    from app.cli.job import unknown_keys
    from app.distributed.hardware.spec import check_launcher

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dict_cfg = compose(config_name="config", overrides=overrides)
    cfg = to_run_config(dict_cfg)
    unknown = unknown_keys(OmegaConf.to_container(dict_cfg, resolve=False), cfg)
    assert not unknown, f"keys past the schema: {unknown}"
    limits_as_given(cfg, overrides)
    cfg.check()
    check_launcher(cfg.hardware, launched)


def compose_command(command: DocCommand, fx: dict[str, Path]) -> int:
    """Compose the command's jobs (raising what the app would refuse with); returns how many."""
    from app.cli.help import app_help, chosen_options

    argv = shlex.split(fill(command, fx), comments=True)
    if "--help" in argv or "-h" in argv:
        text = app_help(CONF_DIR, chosen_options(argv, CONF_DIR))
        for group, option in chosen_options(argv, CONF_DIR).items():
            assert re.search(rf"^   \* {re.escape(option)}\s", text, re.MULTILINE), (group, option)
        return 0
    if "--cfg" in argv:  # --cfg job: print the composed config instead of running it
        del argv[argv.index("--cfg"):argv.index("--cfg") + 2]
    multirun = "-m" in argv or "--multirun" in argv
    argv = entry_argv(argv)
    overrides = [arg for arg in argv if arg not in ("-m", "--multirun")]
    unknown_flags = [arg for arg in overrides if arg.startswith("-")]
    assert not unknown_flags, f"flags this test does not know: {unknown_flags}"
    jobs = jobs_of(overrides, multirun)
    for job in jobs:
        compose_checked(job, command.launched)
    return len(jobs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_command_in_the_docs_composes(command, fixtures, monkeypatch):
    monkeypatch.chdir(fixtures["work"] if command.cwd == "." else REPO / command.cwd)
    imported = set(sys.modules)
    if command.cwd != ".":
        monkeypatch.syspath_prepend(str(REPO / command.cwd))  # python -m app there imports its package
    try:
        compose_command(command, fixtures)
    finally:  # a user's package imported from there (tabular_task) is not left for later tests
        for name in set(sys.modules) - imported:
            if command.cwd != "." and str(REPO / command.cwd) in str(getattr(sys.modules[name], "__file__", "")):
                del sys.modules[name]


def test_a_renamed_key_in_a_doc_command_fails(fixtures, monkeypatch):
    """The check above can fail: a key the schema lacks, an option conf/ lacks, a value a rule refuses."""
    from hydra.errors import ConfigCompositionException

    from app.config import ConfigError

    monkeypatch.chdir(fixtures["work"])
    for text, error in [("trainer.batchsize=64", ConfigCompositionException),
                        ("-m optim.lr=1e-3,3e-3 precision=fp8", ConfigCompositionException),
                        ("+trainer.batchsize=3", AssertionError),
                        ("trainer.batch_size=0", ConfigError),
                        ("resume=outputs/<date>/<time> optim.lrr=1e-3", ConfigCompositionException)]:
        with pytest.raises(error):
            compose_command(DocCommand("test", text, ".", None), fixtures)
    with pytest.raises(ConfigError, match="launcher started 4 process"):
        compose_command(DocCommand("test", "hardware=multi_cpu hardware.num_processes=2", ".", (4, 4)), fixtures)


def test_a_sweep_composes_each_of_its_jobs(fixtures, monkeypatch):
    monkeypatch.chdir(fixtures["work"])
    assert compose_command(DocCommand("test", "-m optim.lr=1e-3,3e-3 trainer.batch_size=32,64", ".", None),
                           fixtures) == 4
    assert compose_command(DocCommand("test", "-m task=glue_cola,glue_rte task.data_dir=<folder> task.model=<model>",
                                      ".", None), fixtures) == 2


# -- links and paths ----------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path).splitlines():
        if match := re.match(r"^#{1,6} (.+)$", line):
            base = slug(match.group(1))
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return out


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
            if re.match(r"[a-z]+:", target):
                continue  # https://, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


RUN_FOLDER = {".hydra", "model", "checkpoints", "samples", "tensorboard", "profile", "hparams", ".slurm", ".submitit",
              "mlartifacts"}
"""First parts of a path inside a run or sweep folder (``model/export.json``), not the repository's."""

USER_SIDE = {".venv", ".venv-xla", "data", "glue_data", "mrpc", "MRPC", "my_lm"}
"""First parts of paths on the user's machine the docs name: environments, data and model folders."""


def repository_paths() -> set[str]:
    found = set()
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in (".git", "__pycache__", "outputs", "multirun")
                   and not d.startswith((".venv", ".mypy", ".ruff", ".pytest"))]
        rel = Path(folder).relative_to(REPO)
        found.update((rel / name).as_posix() for name in files)
        found.update((rel / name).as_posix() + "/" for name in dirs)
    return found


def named_paths(path: Path) -> list[str]:
    """The paths the page names: each word of its backticked spans (``python bench/x.py --rounds 3`` names
    ``bench/x.py``) and of its shell blocks' lines, comments included, that has a slash and an extension
    or ends with one; placeholders (``<...>``, ``...``), overrides (``a/b=c``), URLs, suffix lists
    (``sweep.csv/.md``) and paths outside the repository (``/abs``, ``~``, ``../``, ``outputs/``) are not."""
    words = [w for span in re.findall(r"`([^`\n]+)`", prose(path)) for w in span.split()]
    for block in code_blocks(path):
        if block.lang in SHELL_BLOCKS:
            words += [w for _, line in logical_lines(block) for w in line.split()]
    words = [w.strip("\"'").rstrip(".,;:)") for w in words]
    return [w for w in words
            if "/" in w and not re.search(r"[=<>*$%{}():,@\[\]|]|\.\.\.|…|^[/~]|^\.\./|^outputs/|/\.\w+(/|$)", w)
            and (re.search(r"\.\w{1,8}$", w) or w.endswith("/"))]


def test_every_repository_path_the_docs_name_exists():
    repo = repository_paths()
    top = {p.split("/")[0] for p in repo}
    missing = []
    for page in DOCS:
        for name in named_paths(page):
            first = name.split("/")[0]
            if first in RUN_FOLDER or first in USER_SIDE:
                continue
            relative = Path(page.parent.relative_to(REPO), name).as_posix()  # a path next to the page
            if first in top or first + "/" in repo:
                exists = name.rstrip("/") in {p.rstrip("/") for p in repo}
            else:  # a path inside a package the text is about (hardware/cuda.py, tabular_task/)
                exists = relative in repo or any(p.endswith("/" + name) for p in repo)
            if not exists:
                missing.append(f"{page.relative_to(REPO)}: {name}")
    assert not missing, "named in the docs, not in the repository:\n" + "\n".join(sorted(set(missing)))
