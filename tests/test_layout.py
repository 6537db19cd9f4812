"""The package's layout is its architecture: imports run one way (ops on the adapters on the
core), with no cycle, and nothing in the pure core reaches an I/O library, even indirectly."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gatekeeper"
IO_LIBRARIES = {"celery", "kombu", "redis", "hiredis", "structlog", "billiard", "amqp"}
LAYERS = {"core": 0, "redis": 1, "celery": 2, "ops": 3}
"""A module may import its own layer and the ones below it, never one above."""
SHARED = {"gatekeeper", "gatekeeper.errors", "gatekeeper.defaults"}
"""Top-level modules any layer may import (they import nothing of gatekeeper's but each other)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _skips_type_checking(node: ast.AST) -> bool:
    """Exactly ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``), nothing looser."""
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "TYPE_CHECKING",
        "typing.TYPE_CHECKING",
    )


def _absolute(module: str | None, level: int, path: Path) -> str | None:
    """A relative import's absolute module name (``from ..celery import hook``)."""
    if level == 0:
        return module
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function (not under
    ``if TYPE_CHECKING:``); ``from a import b`` counts ``a.b`` when that is a module."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _skips_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, path)
            if module:
                found.add(module)
                for alias in node.names:
                    if f"{module}.{alias.name}" in modules:
                        found.add(f"{module}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def graph(parents: bool = True) -> dict[str, set[str]]:
    """Module -> the modules it imports; with ``parents``, also the packages that importing
    them runs first (what an import really loads)."""
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(files)
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for imported in imports_of(path, modules):
            targets.add(imported)
            if parents:  # importing a.b.c runs a/__init__ and a/b/__init__ first
                parts = imported.split(".")
                targets.update(".".join(parts[:i]) for i in range(1, len(parts)))
        edges[name] = {t for t in targets if t != name}
    return edges


def closure(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 and parts[0] == "gatekeeper" else None


def test_no_import_cycle_between_gatekeeper_modules() -> None:
    # Explicit imports only: a package's __init__ importing its own submodules is not a cycle.
    edges = graph(parents=False)
    own = {name: {t for t in targets if t in edges} for name, targets in edges.items()}
    cycles = sorted(name for name in own if name in closure(own, name))
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_the_core_reaches_no_io_library_even_indirectly() -> None:
    edges = graph()
    for name in edges:
        if layer(name) != 0:
            continue
        reached = {target.split(".")[0] for target in closure(edges, name)}
        assert not reached & IO_LIBRARIES, f"{name} reaches {sorted(reached & IO_LIBRARIES)}"


def test_imports_run_one_way_ops_on_adapters_on_core() -> None:
    edges = graph()
    wrong = []
    for name, targets in edges.items():
        mine = layer(name)
        for target in targets:
            theirs = layer(target)
            if target.startswith("gatekeeper") and target not in SHARED and theirs is None:
                theirs = -1  # a top-level module such as settings or logs: below the adapters
                if mine == 0:
                    wrong.append((name, target))
            if mine is not None and theirs is not None and theirs > mine:
                wrong.append((name, target))
    assert wrong == []


def test_core_modules_load_no_io_library_when_imported() -> None:
    core = sorted(module_name(p) for p in (PACKAGE / "core").glob("*.py"))
    code = (
        "import sys\n"
        f"for name in {core!r}: __import__(name)\n"
        f"bad = sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(IO_LIBRARIES)!r}))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing the core loaded {out.stdout.strip()}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: module_name(p))
def test_every_module_has_a_docstring_and_stays_short(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{module_name(path)} has no module docstring"
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 360, f"{module_name(path)} has {lines} lines"


def test_the_core_imports_nothing_the_walk_cannot_see() -> None:
    # Dynamic imports and the package's lazy names would load an adapter unseen by the walk.
    from gatekeeper import _LAZY

    for path in sorted((PACKAGE / "core").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                assert not called.endswith(("import_module", "__import__")), (path, called)
            if isinstance(node, ast.ImportFrom) and node.module == "gatekeeper":
                lazy = {alias.name for alias in node.names} & set(_LAZY)
                assert not lazy, (path, lazy)
