"""Sessions: plan → policy → preflight → account → firewall → spawn → monitor → terminate → cleanup →
audit, as a LangGraph graph (:mod:`.graph`) of steps (:mod:`.nodes`) over one state (:mod:`.state`);
configuration (:mod:`.config`). Harness profiles and the bundled scripted agent are :mod:`agentcell.harness`'s.

Names are imported on first use: importing this package does not import LangGraph.
"""
from __future__ import annotations

from typing import Any

_WHERE = {"build_graph": "graph", "run": "graph", "recover": "graph", "Runtime": "state",
          "SessionState": "state", "SessionConfig": "config", "load_config": "config", "PROFILES": "profiles"}
_NAMES = {"load_config": "load"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(__import__(f"{__name__}.{module}", fromlist=[name]), _NAMES.get(name, name))
