"""The package's layout: imports point one way (no cycles; cli at the top, ops at the bottom) and
the trainer stays a loop over small pieces. Read from the source with ast: nothing is imported.

Every import statement counts, wherever it is: at module level, inside a function (a lazy
import), or under `if TYPE_CHECKING:`. A lazy import only moves the moment the module is
loaded; it is still a dependency, and a cycle through one is still a cycle. The one edge not
counted is Python's own: importing minagi.x first runs minagi/__init__.py, which every module
would otherwise depend on."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minagi"

# Top to bottom. A module may import modules of its own layer or of layers below it, never above.
# A module that is not listed fails the test: place it where it belongs. The application
# (minagi.lm) sits above the library (minagi.moe); minagi itself is the front of both.
LAYERS = [
    ("entry points", {"minagi.__main__", "minagi.bench", "minagi.bench.*"}),
    ("front", {"minagi"}),
    ("command line", {"minagi.lm.cli"}),
    ("commands and training", {"minagi.lm.trainer", "minagi.lm.step", "minagi.lm.progress", "minagi.lm.run",
                               "minagi.lm.history", "minagi.lm.writer", "minagi.lm.routes", "minagi.lm.evaluate",
                               "minagi.lm.plot", "minagi.lm.checkpoint", "minagi.lm.allocator",
                               "minagi.lm.cores"}),
    ("model", {"minagi.lm.model", "minagi.lm.optim"}),
    ("pool", {"minagi.lm.pool"}),
    # Leaves of the application: names and helpers its layers share; they import only each other.
    ("application leaves", {"minagi.lm", "minagi.lm.config", "minagi.lm.balance", "minagi.lm.data",
                            "minagi.lm.guard", "minagi.lm.distributed", "minagi.lm.memory", "minagi.lm.prog"}),
    # The library: imports nothing above this line.
    ("library front ends", {"minagi.moe", "minagi.moe.hf", "minagi.moe.expert_parallel"}),
    ("dispatch", {"minagi.moe.dispatch"}),
    ("ops", {"minagi.moe.ops", "minagi.moe.reference", "minagi.moe._backend", "minagi.moe.quant"}),
]
LIBRARY = "minagi.moe"
APPLICATION = "minagi.lm"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known) -> set[str]:
    """The package's modules that `name` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x, from .x import y, from ..x import y
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:  # from pkg import submodule, or from module import a name
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, mods) for name, path in mods.items()}


def find_cycle(edges: dict) -> list | None:
    """A cycle of the directed graph {node: its successors} as [a, b, ..., a], or None."""
    state: dict = {}  # absent: not seen; 1: on the current path; 2: done

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def layer_of(name: str) -> int | None:
    for i, (_, members) in enumerate(LAYERS):
        if name in members or any(m.endswith(".*") and name.startswith(m[:-1]) for m in members):
            return i
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"a"}, "a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None  # a diamond is no cycle


def test_the_graph_sees_every_kind_of_import(tmp_path, monkeypatch):
    pkg = tmp_path / "minagi"
    (pkg / "sub").mkdir(parents=True)
    for name, text in {"__init__.py": "from .a import f\n", "a.py": "def f():\n    from . import b\n",
                       "b.py": "import minagi.c\n", "c.py": "from minagi.sub import d\n",
                       "sub/__init__.py": "", "sub/d.py": "from ..a import f\n"}.items():
        (pkg / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    g = graph()
    assert g == {"minagi": {"minagi.a"}, "minagi.a": {"minagi.b"}, "minagi.b": {"minagi.c"},
                 "minagi.c": {"minagi.sub.d"}, "minagi.sub": set(), "minagi.sub.d": {"minagi.a"}}
    assert find_cycle(g) == ["minagi.a", "minagi.b", "minagi.c", "minagi.sub.d", "minagi.a"]


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle in minagi/: " + " -> ".join(cycle)


def test_imports_point_down():
    g = graph()
    unplaced = sorted(m for m in g if layer_of(m) is None)
    assert not unplaced, f"place {', '.join(unplaced)} in a layer of tests/test_layout.py's LAYERS"
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in sorted(g.items()) for d in sorted(deps) if layer_of(d) < layer_of(m)]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


@pytest.mark.parametrize("low, high", [("minagi.lm.pool", "minagi.lm.checkpoint"), ("minagi.moe.expert_parallel", "minagi.lm.checkpoint"),
                                       ("minagi.lm.checkpoint", "minagi.lm.cli"), ("minagi.lm.routes", "minagi.lm.cli"),
                                       ("minagi.moe.ops", "minagi.moe.dispatch"), ("minagi.moe.dispatch", "minagi.lm.pool"),
                                       ("minagi.lm.pool", "minagi.lm.model"), ("minagi.lm.model", "minagi.lm.trainer")])
def test_a_lower_module_never_reaches_a_higher_one(low, high):
    g, seen, todo = graph(), set(), [low]
    while todo:
        for d in g[todo.pop()] - seen:
            seen.add(d)
            todo.append(d)
    assert high not in seen


def test_the_library_imports_nothing_from_the_application():
    g = graph()
    library = {m for m in g if m == LIBRARY or m.startswith(LIBRARY + ".")}
    assert library, "no library modules found"
    wrong = [f"{m} imports {d}" for m in sorted(library) for d in sorted(g[m])
             if d == APPLICATION or d.startswith(APPLICATION + ".") or d == "minagi.bench" or d.startswith("minagi.bench.")]
    assert not wrong, "the library (minagi.moe) must not import the application or the bench:\n" + "\n".join(wrong)


@pytest.mark.slow
def test_the_front_loads_the_application_only_when_asked():
    import subprocess

    code = ("import sys, minagi, minagi.hf, minagi.quant; assert minagi.hf is sys.modules['minagi.moe.hf']; assert minagi.quant is sys.modules['minagi.moe.quant']; "
            "assert not [m for m in sys.modules if m.startswith('minagi.lm')], sorted(sys.modules); "
            "minagi.PooledMLP; assert 'minagi.lm.pool' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_trainer_functions_are_short():
    tree = ast.parse((PACKAGE / "lm" / "trainer.py").read_text())
    long = [f"{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long
