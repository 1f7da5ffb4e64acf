"""The layering docs/ARCHITECTURE.md claims, checked on the source: no import circle among agentcell's
modules (lazy and TYPE_CHECKING imports counted too; a package importing its own submodules is not
one), and cell/ imports nothing above it."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "agentcell"
BELOW_CELL = {"agentcell.errors", "agentcell.hostfs"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        name = ".".join(("agentcell", *p.relative_to(SRC).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = p
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                # `from . import x` imports the submodule x (its package is already being imported)
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name and t != "agentcell":
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    assert _cycles(_graph()) == []


def test_cell_imports_nothing_above_it() -> None:
    up = sorted(f"{m} -> {d}" for m, deps in _graph().items() if m.startswith("agentcell.cell")
                for d in deps if not d.startswith("agentcell.cell") and d not in BELOW_CELL)
    assert up == []


def test_the_check_sees_an_import() -> None:
    assert "agentcell.cell.launch" in _graph()["agentcell.supervise"]


def test_the_network_modes_have_one_definition() -> None:
    """cell.spec.NETWORK_MODES; the Literal types spell them again for type checkers, equal to it."""
    from typing import get_args

    from agentcell.cell.spec import NETWORK_MODES
    from agentcell.policy.models import Network

    assert get_args(Network) == NETWORK_MODES
    spec_source = (SRC / "cell" / "spec.py").read_text()
    spelled = ", ".join(f'"{m}"' for m in NETWORK_MODES)
    assert f"NetworkMode = Literal[{spelled}]" in spec_source
    others = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
              if '"none", "loopback", "proxy", "host-firewall"' in p.read_text()]
    assert sorted(others) == ["cell/spec.py", "policy/models.py"]
