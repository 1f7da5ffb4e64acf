"""What the agent accounts on this machine are and how they are: the listing behind ``agentcell agent list``
and the health report behind ``agentcell agent info``, as plain data (JSON as those commands print it)."""
from __future__ import annotations

from typing import Any

from . import ephemeral
from .accounts import cells_running, health
from .registry import open_registry


def listing() -> dict[str, list[dict[str, Any]]]:
    """Every persistent agent (with the processes it has in cells) and every session account left behind."""
    with open_registry() as reg:
        agents = list(reg.agents.values())
    return {"agents": [{"name": r.name, **r.as_dict(), "cells": cells_running(r)} for r in agents],
            "session_accounts": [{"name": a.name, "uid": a.uid, "session_id": a.session_id}
                                 for a in ephemeral.leftovers()]}


def report(name: str) -> dict[str, Any]:
    """The agent's record and each health check; ``healthy`` when every check is."""
    with open_registry() as reg:
        rec = reg.get(name)
    checks = health(rec)
    return {"name": rec.name, **rec.as_dict(), "healthy": all(c[1] for c in checks),
            "checks": [{"check": c, "ok": o, "detail": d} for c, o, d in checks]}
