"""The one place the session starts a cell: :class:`agentcell.supervise.Supervised` (the cell with its
proxy, host-firewall table and escape monitor), with the monitor's verdict ``terminate``: the first
escape attempt freezes and kills the cell, and the session's monitor node sees it in ``events()``."""
from __future__ import annotations

from collections.abc import Sequence

from ..cell.spec import CellSpec
from ..supervise import Supervised

__all__ = ["Supervised", "start"]


def start(spec: CellSpec, argv: list[str], *, stdio: Sequence[int] = (0, 1, 2)) -> Supervised:
    return Supervised.start(spec, argv, monitor="terminate", stdio=stdio)
