"""The package's import graph, read from the source: no circle anywhere in ``slora_batch/``,
neither between modules nor between its packages (function-level imports count, so a circle
cannot hide inside a function), ``jobs/`` imports nothing of ``eval/``, and the engine's rooms
import only downward, in the order ``slora_batch/engine/__init__.py`` lists them.

An import under ``if TYPE_CHECKING:`` is left out: it is never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "slora_batch"
ROOT = Path(__file__).resolve().parents[1]

# The engine's rooms, lowest first: a module may import its own room and the rooms before it.
ROOMS = [
    ("foundations", ["config", "counters", "device", "hub", "pool", "resolution"]),
    ("models", ["models"]),
    ("requests", ["requests"]),
    ("adapters", ["adapters"]),
    ("scheduling", ["scheduling"]),
    ("execution", ["execution"]),
    ("loop", ["engine", "prepare"]),
    ("parallel", ["parallel"]),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, outside ``if TYPE_CHECKING:`` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(child)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports(node)


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}; ``from pkg import name`` counts as an import
    of ``pkg.name`` when that is a module, else of ``pkg``."""
    files = {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([node.module] if node.module else []))
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a name: its module
                    target = target.rpartition(".")[0]
                if target:
                    deps.add(target)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def room_of(module: str) -> int | None:
    """The rank of an engine module's room (0 = lowest), None outside the engine's rooms."""
    prefix = f"{PACKAGE}.engine."
    if not module.startswith(prefix):
        return None
    first = module[len(prefix) :].split(".")[0]
    for rank, (_, names) in enumerate(ROOMS):
        if first in names:
            return rank
    raise AssertionError(f"{module} is in none of the engine's rooms {[r for r, _ in ROOMS]}")


def test_no_import_cycle():
    found = cycles(import_graph(ROOT))
    assert not found, "import cycles in slora_batch/: " + "; ".join(
        " <-> ".join(component) for component in found
    )


def package_of(module: str) -> str:
    """The package of ``slora_batch`` a module belongs to: ``slora_batch.jobs`` for
    ``slora_batch.jobs.run``, a top-level module itself (``slora_batch.runner``), and
    ``slora_batch`` for the root's ``__init__``."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{package: the other packages its modules import}."""
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        here = package_of(module)
        packages.setdefault(here, set()).update(
            package_of(dep) for dep in deps if package_of(dep) != here
        )
    return packages


def test_no_import_cycle_between_packages():
    """Packages import each other one way only (``runner`` sits above ``jobs`` and ``eval``):
    a function-level import counts, so a circle cannot hide inside a function."""
    found = cycles(package_graph(import_graph(ROOT)))
    assert not found, "import cycles between packages of slora_batch/: " + "; ".join(
        " <-> ".join(component) for component in found
    )


def test_jobs_import_nothing_of_eval():
    """The job tool runs without lm-eval's bridge: an eval job plugs in from above
    (``slora_batch.runner``), and its ``eval:`` keys are the job file's (``jobs/eval_keys.py``)."""
    graph = import_graph(ROOT)
    found = sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        if package_of(module) == f"{PACKAGE}.jobs"
        for dep in deps
        if package_of(dep) == f"{PACKAGE}.eval"
    )
    assert not found, "jobs/ imports eval/: " + ", ".join(found)


def test_package_graph_sees_a_circle_through_function_level_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    for name in ("jobs", "eval"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "jobs" / "run.py").write_text("def f():\n    from slora_batch.eval import sweep\n")
    (pkg / "eval" / "sweep.py").write_text("from slora_batch.jobs.run import f\n")
    packages = package_graph(import_graph(tmp_path))
    assert packages[f"{PACKAGE}.jobs"] == {f"{PACKAGE}.eval"}
    assert cycles(packages) == [[f"{PACKAGE}.eval", f"{PACKAGE}.jobs"]]


def test_rooms_import_only_downward():
    graph = import_graph(ROOT)
    upward = []
    for module, deps in sorted(graph.items()):
        rank = room_of(module)
        for dep in sorted(deps):
            if module.startswith(f"{PACKAGE}.engine") and not dep.startswith(f"{PACKAGE}.engine"):
                upward.append(f"{module} -> {dep} (the engine imports no other package)")
            dep_rank = room_of(dep)
            if rank is not None and dep_rank is not None and dep_rank > rank:
                upward.append(f"{module} ({ROOMS[rank][0]}) -> {dep} ({ROOMS[dep_rank][0]})")
    assert not upward, "imports from a lower room up to a higher one:\n" + "\n".join(upward)


def test_rooms_say_what_they_own():
    engine = ROOT / PACKAGE / "engine"
    for init in sorted(engine.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init}: its docstring says not what the room may import"
        assert init.parent.name in (engine / "__init__.py").read_text(), (
            f"{init.parent.name}/ is missing from slora_batch/engine/__init__.py's map"
        )


def test_graph_reader_sees_function_level_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from slora_batch import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nimport slora_batch.a\n"
        "if TYPE_CHECKING:\n    from slora_batch.c import C\n"
    )
    (pkg / "c.py").write_text("from slora_batch.b import x\n")
    graph = import_graph(tmp_path)
    assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.b"}
    assert graph[f"{PACKAGE}.b"] == {f"{PACKAGE}.a"}
    assert cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.b"]]
