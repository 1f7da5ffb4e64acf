"""agentcell: run AI coding agents in a least-privilege Linux cell.

The public face. Names are imported lazily so ``agentcell run`` (which imports ``agentcell.cli``)
pays only for what it uses.
"""
from __future__ import annotations

TYPE_CHECKING = False  # typing costs ~10 ms to import; see cell/spec.py
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Cell": "agentcell.api",
    "CellCompleted": "agentcell.api",
    "CellProcess": "agentcell.api",
    "CellSpec": "agentcell.cell.spec",
    "Identity": "agentcell.cell.spec",
    "AgentcellError": "agentcell.errors",
    "PolicyError": "agentcell.errors",
    "LaunchError": "agentcell.errors",
    "build_graph": "agentcell.session.graph",  # imports LangGraph: only when asked for
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(__import__(_LAZY[name], fromlist=[name]), name)  # importlib costs ~0.6 ms here
    raise AttributeError(f"module 'agentcell' has no attribute {name!r}")
