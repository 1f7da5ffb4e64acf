"""Sessions beyond one machine: plans as plain data (:mod:`.plan`), run where agentcell runs as
root. :mod:`.node` runs one plan on the machine it is on (no Ray); :mod:`.cluster` spreads plans over a Ray
cluster (the ``agentcell[ray]`` extra); :mod:`agentcell.k8s` renders a plan as agent-sandbox resources.
The fleet schedules nothing itself: Ray (or Kubernetes) does.
"""
from __future__ import annotations

from types import ModuleType


def ray_cluster() -> ModuleType:
    """:mod:`.cluster`, or the error that says how to install Ray (it is an extra)."""
    try:
        from . import cluster
    except ImportError as e:
        if getattr(e, "name", "") == "ray" or "ray" in str(e):
            from ..errors import AgentcellError

            raise AgentcellError("fleet", "Ray is not installed", "pip install 'agentcell[ray]'") from None
        raise
    return cluster
