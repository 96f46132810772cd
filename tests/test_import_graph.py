"""The shape of ``app/``, read from its source with ``ast`` (nothing is imported):

- no import cycle between its modules, and no module imports one of a layer above its own (LAYERS, one
  set of folders each: the root's modules and ``console/`` → ``run_folder/``, ``workers/`` →
  ``distributed/``, ``tasks/`` → ``engine/`` → ``launching/``, ``sweeps/``, ``report/`` → ``cli/``);
- the root of ``app/`` holds the foundation only: at most six modules;
- no module of ``app/engine`` imports ``torch.distributed``, ``torch_xla`` or a CUDA-specific API: the
  engine is the code that runs inside a worker, whatever the hardware (the device names themselves are
  kept out by ``test_engine.py``);
- no private attribute of an ``Accelerator`` is read outside ``app/distributed/accelerator.py`` and the
  parts it is made of (``app/distributed/facade/``);
- ``app/engine`` talks to the runtime through the Accelerator and its prepared loaders only: it reads
  no ``.backend`` (nor what hangs off one) and no loader internals such as ``.batch_sampler``.

The import graph: one node per module, a package being its ``__init__``. Every ``import`` counts,
function-local ones too (they still tie the two modules together), except those under
``if TYPE_CHECKING:``. ``from pkg import name`` depends on ``pkg.name`` when that is a module, else on
``pkg``; relative imports are resolved.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"

# The layers of app/, lowest first, each a set of folders (the packages directly under app/; "app" is the
# modules at its root, the foundation every layer may import). A module belongs to the layer of its
# folder, and imports modules of its own layer and of those below, never of one above (what a lower
# layer needs from a higher one is a callable passed in). Every folder must be in a layer. The one
# exception is named: ``app/__main__.py``, the few lines of ``python -m app`` that hand over to app.cli.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("app", "app.console")),
    ("run folder and worker processes", ("app.run_folder", "app.workers")),
    ("runtime and tasks", ("app.distributed", "app.tasks")),
    ("engine", ("app.engine",)),
    ("launching", ("app.launching", "app.sweeps", "app.report")),
    ("command line", ("app.cli", "app.__main__")),
)
ROOT_MODULES_AT_MOST = 6
"""The foundation at the root of app/ (``__init__`` and ``__main__`` included); the rest lives in folders."""

# What a module of app/engine must not import: the collective library, XLA, CUDA's own API.
ENGINE_FORBIDDEN = ("torch.distributed", "torch_xla", "torch.cuda", "torch.backends.cuda", "torch.backends.cudnn")


# -- reading the source --------------------------------------------------------------------------------------
def modules(root: Path = APP) -> dict[str, Path]:
    """Dotted name -> file, for every module under ``root`` (a package is its ``__init__.py``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node`` except the body of an ``if TYPE_CHECKING:`` (its ``else`` counts)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield child
        yield from _runtime_nodes(child)


def imported_names(path: Path, name: str) -> Iterator[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of each runtime import in the file, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                yield module, alias.name, node.lineno


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``mods`` it imports."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for module, item, _ in imported_names(path, name):
            if item is not None and f"{module}.{item}" in mods:
                deps.add(f"{module}.{item}")
                continue
            # The module itself, or the nearest package above a name that is no module.
            while module and module not in mods:
                module = module.rpartition(".")[0]
            if module:
                deps.add(module)
        graph[name] = deps - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module (each a set of modules that import each other, sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative Tarjan: (node, iterator over its successors).
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the component's first module, as a path that ends where it starts."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    return component


# -- the rules ---------------------------------------------------------------------------------------------------
def test_the_graph_reader_sees_what_python_imports(tmp_path):
    """The reader itself, on a small package: relative, function-local and TYPE_CHECKING imports."""
    pkg = tmp_path / "app"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from app.a import x\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app import b\nx = 1\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n    from .sub.c import y\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom app import sub\nimport app.b\nfrom app.sub.c import nothing\n")
    graph = import_graph(modules(pkg))
    assert graph == {"app": {"app.a"}, "app.a": set(), "app.b": {"app.sub.c"}, "app.sub": set(),
                     "app.sub.c": {"app.a", "app.sub", "app.b"}}
    assert strongly_connected(graph) == [["app.b", "app.sub.c"]]
    assert a_cycle(graph, ["app.b", "app.sub.c"]) == ["app.b", "app.sub.c", "app.b"]


def test_no_import_cycle_in_app():
    graph = import_graph(modules())
    cycles = [" -> ".join(a_cycle(graph, component)) for component in strongly_connected(graph)]
    assert not cycles, "import cycle(s) in app/:\n" + "\n".join(cycles)


def folder_of(module: str) -> str:
    """The folder directly under app/ that holds the module (``app.engine.loop`` -> ``app.engine``), or
    ``app`` for a module at the root (``app.config``) and the package itself."""
    parts = module.split(".")
    return f"app.{parts[1]}" if len(parts) > 1 and (APP / parts[1]).is_dir() else "app"


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the module's layer (None: in no layer): the module's own entry (the named
    exception), else its folder's."""
    for name in (module, folder_of(module)):
        for index, (_, names) in enumerate(LAYERS):
            if name in names:
                return index
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module whose layer is above the importer's."""
    found = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            low, high = layer_of(module), layer_of(dep)
            if low is not None and high is not None and high > low:
                found.append(f"{module} ({LAYERS[low][0]}) imports {dep} ({LAYERS[high][0]})")
    return found


def test_no_module_imports_one_above_it_in_the_layering():
    assert [layer_of(m) for m in ("app", "app.config", "app.console.logs", "app.run_folder.layout", "app.engine.loop",
                                  "app.cli.configure", "app.__main__")] == [0, 0, 0, 1, 3, 5, 5]
    assert upward_imports({"app.engine.run": {"app.cli.job", "app.config"}, "app.cli.job": {"app.config"}}) == [
        "app.engine.run (engine) imports app.cli.job (command line)"]
    graph = import_graph(modules())
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add their folder to LAYERS in this file): {unplaced}"
    upward = upward_imports(graph)
    assert not upward, "imports of a layer above the importer's:\n" + "\n".join(upward)


def test_the_root_of_app_holds_the_foundation_only():
    """Fabric's folders by role: nothing of substance loose at the package root; each folder under app/
    is a layer's (a new one must be placed in LAYERS)."""
    root = sorted(path.name for path in APP.glob("*.py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, f"app/ holds {len(root)} modules at its root: {root}"
    folders = sorted(f"app.{path.parent.name}" for path in APP.glob("*/__init__.py"))
    placed = {name for _, names in LAYERS for name in names}
    assert not [folder for folder in folders if folder not in placed], f"folders in no layer: {folders}"


def test_no_module_in_app_is_longer_than_600_lines():
    """A module a reader can hold: past 600 lines it does several jobs (split it by job, as the
    Accelerator's methods are in app/distributed/facade/)."""
    long = {str(path.relative_to(REPO)): n for path in APP.rglob("*.py")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > 600}
    assert not long, long


def engine_offences(path: Path, name: str) -> list[str]:
    """Where the module imports or reaches a forbidden API."""
    found = []
    for module, item, line in imported_names(path, name):
        full = f"{module}.{item}" if item else module
        if _forbidden(full):  # ``from torch import distributed`` is read as torch.distributed too
            found.append(f"{line}: imports {full}")
    # ``import torch`` then ``torch.cuda.synchronize()`` reaches the same APIs without importing them.
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and _forbidden(ast.unparse(node)):
            found.append(f"{node.lineno}: uses {ast.unparse(node)}")
    return found


def test_engine_imports_no_collective_xla_or_cuda_api(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nfrom torch import distributed as dist\nimport torch_xla.core\n"
                      "def f():\n    torch.cuda.synchronize()\n    return torch.distributions\n")
    assert engine_offences(sample, "app.engine.sample") == [
        "2: imports torch.distributed", "3: imports torch_xla.core", "5: uses torch.cuda.synchronize",
        "5: uses torch.cuda"]
    offenders = [f"{path.relative_to(REPO)}:{where}" for name, path in modules().items()
                 if name.startswith("app.engine.") for where in engine_offences(path, name)]
    assert offenders == []


def _forbidden(dotted: str) -> bool:
    return any(dotted == bad or dotted.startswith(bad + ".") for bad in ENGINE_FORBIDDEN)


# What app/engine must not reach past the facade: the Accelerator's backend and what hangs off one, and
# the internals of a prepared loader (its sampler, the DataLoader it wraps).
ENGINE_UNREACHABLE = ("backend", "checkpoint_io", "batch_sampler", "sampler", "base_dataloader")


def reaches_past_the_facade(path: Path) -> list[str]:
    """Where the module reads one of ENGINE_UNREACHABLE, as ``obj.name`` or ``getattr(obj, "name")``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_UNREACHABLE:
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_UNREACHABLE):
            found.append((node.lineno, node.args[1].value))
    return [f"{line}: reads .{name}" for line, name in sorted(found)]


def test_engine_talks_to_the_accelerator_and_its_loaders_only(tmp_path):
    """Fabric's rule: the loop and its helpers use the runtime's public verbs (``broadcast_object``,
    ``step_flag``, ``load_model``, a loader's ``epoch``...), never the backend behind them."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f(acc, loader):\n    acc.backend.step_flag()\n    return loader.batch_sampler.epoch, loader.epoch\n"
                      "def g(acc):\n    return getattr(acc, 'backend'), acc.step_flag()\n")
    assert reaches_past_the_facade(sample) == ["2: reads .backend", "3: reads .batch_sampler", "5: reads .backend"]
    offenders = [f"{path.relative_to(REPO)}:{where}" for name, path in modules().items()
                 if name == "app.engine" or name.startswith("app.engine.") for where in reaches_past_the_facade(path)]
    assert offenders == [], "app/engine reaches past the Accelerator: " + ", ".join(offenders)


# The Accelerator's class and the mixins it is made of.
ACCELERATOR_FILES = tuple(APP / "distributed" / name for name in (
    "accelerator.py", "facade/fields.py", "facade/prepare.py", "facade/training_step.py", "facade/collectives.py",
    "facade/saving.py"))


def accelerator_private_names() -> set[str]:
    """The private attributes an Accelerator has: what its classes assign to ``self._x``, and their ``_x`` methods."""
    classes = [node for path in ACCELERATOR_FILES for node in ast.parse(path.read_text()).body
               if isinstance(node, ast.ClassDef)]
    names = set()
    for node in (node for cls in classes for node in ast.walk(cls)):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and node.value.id == "self"):
            names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_private_accelerator_attribute_read_outside_its_file():
    """Sound without type inference: any ``obj._x`` (obj not ``self``/``cls``) where ``_x`` is one of the
    Accelerator's private names counts, whatever ``obj`` is; another class's own ``self._x`` does not."""
    private = accelerator_private_names()
    assert {"_models", "_optimizers", "_micro_step", "_gradients"} <= private  # the reader found the class's fields
    reads = set()
    for path in sorted(APP.rglob("*.py")):
        if path in ACCELERATOR_FILES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                reads.add((str(path.relative_to(REPO)), node.attr))
    assert not reads, f"private Accelerator attributes read outside accelerator.py: {sorted(reads)}"
