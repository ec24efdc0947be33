"""The house rules DESIGN.md states about the code's shape: no import circles among hybrid's
modules, and no folder of more than 15 modules.

An import counts wherever it is written: at module level (it runs when the module is imported),
inside a function (a lazy import runs on first call: a circle through it is a circle all the same,
only put off), under ``if TYPE_CHECKING:`` (the annotations still tie the two modules together),
and as a module named by a string to ``importlib.import_module`` (the PEP 562 tables of
``hybrid.models`` and ``hybrid.demo``, the checkpoint formats' registry). Importing a package's
module also runs the package's ``__init__``; that is not counted as an edge, or every package
whose ``__init__`` re-exports its modules would be a circle.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hybrid"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def _module_of(name: str, mods) -> str | None:
    """The hybrid module ``name`` imports: itself, or the package holding the attribute it names."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(source: str, mods) -> set[str]:
    """The hybrid modules ``source`` imports anywhere (see the module docstring): a string names a
    module only in a source that calls ``importlib.import_module``, and never as a docstring."""
    tree = ast.parse(source)
    by_name = any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree))
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("hybrid"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in mods else _module_of(node.module, mods))
        elif isinstance(node, ast.Import):
            out |= {_module_of(a.name, mods) for a in node.names if a.name.startswith("hybrid")}
        elif (by_name and isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in mods
              and id(node) not in docstrings):
            out.add(node.value)
    out.discard(None)
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: the hybrid modules it imports}`` over every module of hybrid/."""
    mods = _modules()
    return {m: imports_of(f.read_text(), mods) - {m} for m, f in mods.items()}


def _circles(graph: dict[str, set[str]]) -> list[str]:
    state, circles = {}, []

    def visit(u, path):
        state[u] = "open"
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                circles.append(" -> ".join(path[path.index(v):] + [v]))
            elif v in graph and v not in state:
                visit(v, path + [v])
        state[u] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return circles


def test_no_import_circles():
    circles = _circles(import_graph())
    assert not circles, "import circles (lazy imports included):\n" + "\n".join(circles)


def test_the_check_sees_lazy_and_by_name_imports():
    """The check itself: a circle closed by a function-level import, a TYPE_CHECKING import or an
    importlib name is found; a package __init__ re-exporting its module is not a circle."""
    mods = {"hybrid.a": None, "hybrid.b": None, "hybrid.p": None, "hybrid.p._m": None}
    sources = {
        "hybrid.a": "from hybrid.b import thing\n",
        "hybrid.b": "def f():\n    from hybrid.a import other\n",
        "hybrid.p": "from hybrid.p._m import x\n",
        "hybrid.p._m": "import numpy\n",
    }
    graph = {m: imports_of(s, mods) - {m} for m, s in sources.items()}
    assert _circles(graph) == ["hybrid.a -> hybrid.b -> hybrid.a"]
    sources["hybrid.b"] = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hybrid.a import other\n"
    assert _circles({m: imports_of(s, mods) - {m} for m, s in sources.items()})
    sources["hybrid.b"] = "import importlib\ndef f():\n    return importlib.import_module('hybrid.a')\n"
    assert _circles({m: imports_of(s, mods) - {m} for m, s in sources.items()})


def test_no_folder_past_fifteen_modules():
    crowded = {str(d.relative_to(ROOT.parent)): n for d in [ROOT, *ROOT.rglob("*")] if d.is_dir()
               for n in [len([f for f in d.glob("*.py") if f.name != "__init__.py"])] if n > 15}
    assert not crowded, f"folders past 15 modules (give them sub-packages): {crowded}"
