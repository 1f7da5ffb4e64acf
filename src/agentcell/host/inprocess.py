"""The in-process host: :class:`agentcell.supervise.Supervised` in this process, as a
:class:`~agentcell.host.base.CellHost`."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .base import LiveHandle, StartOptions

if TYPE_CHECKING:
    from ..cell.spec import CellSpec
    from ..supervise import Supervised


class InProcessCell:
    """:class:`Supervised` as a :class:`CellHandle` (its events as dicts)."""

    def __init__(self, sup: Supervised) -> None:
        self.sup = sup
        self.cell_id, self.pid1 = sup.cell_id, sup.pid1
        self.lost = False

    def events(self) -> list[dict[str, Any]]:
        return [e.as_dict() for e in self.sup.events()]

    def stats(self) -> dict[str, Any]:
        return dict(self.sup.stats())

    def poll(self) -> dict[str, Any] | None:
        return self.sup.poll()

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        return self.sup.wait(timeout)

    def settle(self, timeout: float) -> None:
        time.sleep(timeout)  # (the supervisor's threads gather its news; nothing here to wait on)

    def signal(self, sig: int) -> None:
        self.sup.running.forward(sig)

    def terminate(self, reason: str) -> None:
        self.sup.terminate(reason)


class InProcess:
    """Cells supervised in this process. For a single-threaded caller only: the launcher forks, and a
    fork from a threaded process may leave the child a lock that is never released. A live cell needs
    a loop serving its commands: that loop is the cell host's (:mod:`agentcell.host.server`), which is
    this host's ``open``; a threaded program opens one through :class:`RemoteHost`."""

    def start(self, spec: CellSpec, argv: Sequence[str], *, stdio: Sequence[int] = (0, 1, 2),
              monitor: str | None = None, options: StartOptions | None = None) -> InProcessCell:
        from ..supervise import Supervised

        o = options or StartOptions(guard=True)
        return InProcessCell(Supervised.start(spec, argv, monitor=monitor, stdio=stdio, dedicated=o.dedicated,
                                              guard=o.guard, adopt=o.firewall, credentials=o.credentials,
                                              upstream_ca=o.upstream_ca))

    def open(self, spec: CellSpec, *, monitor: str | None = "terminate") -> LiveHandle:
        from .remote import RemoteHost

        return RemoteHost(None).open(spec, monitor=monitor)

    def close(self) -> None:
        pass
