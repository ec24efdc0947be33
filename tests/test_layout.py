"""The house rules DESIGN.md states about the code's shape: no import circles among hybrid's
modules (counting module-level imports, which run at import time), and no folder of more than 15
modules."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hybrid"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def _graph(mods) -> dict[str, set[str]]:
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.parse(f.read_text()).body:  # module level: what runs when m is imported
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybrid"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    graph[m].add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names if a.name in mods}
    return graph


def test_no_import_circles():
    graph = _graph(_modules())
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
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_folder_past_fifteen_modules():
    crowded = {str(d.relative_to(ROOT.parent)): n for d in [ROOT, *ROOT.rglob("*")] if d.is_dir()
               for n in [len([f for f in d.glob("*.py") if f.name != "__init__.py"])] if n > 15}
    assert not crowded, f"folders past 15 modules (give them sub-packages): {crowded}"
