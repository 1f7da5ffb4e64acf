"""The one place the session starts a cell: :class:`agentcell.supervise.Supervised` (the cell with its
proxy, host-firewall table and escape monitor, verdict ``terminate``) in a cell host of its own
(:class:`agentcell.host.remote.RemoteHost`), because the graph's process has LangGraph's worker
threads and the launcher must not fork from it: forked by the user's warm launcher when one runs (its
modules imported), else started for the cell. Any other :class:`~agentcell.host.base.CellHost` may
stand in (a test's :class:`~agentcell.host.fake.FakeHost`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..cell.spec import CellSpec
from ..host.base import CellHandle, CellHost, StartOptions


def start(spec: CellSpec, argv: list[str], *, stdio: Sequence[int] = (0, 1, 2),
          firewall: tuple[Any, Any] | None = None, credentials: Any = None,
          upstream_ca: str | None = None, host: CellHost | None = None) -> CellHandle:
    """``firewall``: the session's host-firewall table and log reader, handed to the host (which removes
    them with the cell); the caller closes its copy of the reader once this returns. ``credentials``
    (:class:`agentcell.network.credentials.CredentialSet`): injected by the cell's proxy. A session's
    account (its own, or a persistent agent's) runs nothing outside its cells, and its cleanup checks the
    protected paths itself: the cell is ``dedicated`` and the host runs no protected-path step."""
    options = StartOptions(dedicated=True, guard=False, firewall=firewall, credentials=credentials,
                           upstream_ca=upstream_ca, session=True)
    if host is not None:
        return host.start(spec, argv, stdio=stdio, monitor="terminate", options=options)
    from ..host.remote import HostUnavailable, RemoteHost
    from ..hostfs import warm_wanted

    if not options.fds() and warm_wanted():  # (a host-firewall's log socket goes to a host started for it)
        try:  # the user's warm launcher forks the cell's host, its modules imported, when one runs
            return RemoteHost("warm").start(spec, argv, stdio=stdio, monitor="terminate", options=options)
        except HostUnavailable:
            pass  # none runs (or it ended before the cell started): nothing ran
    return RemoteHost(None).start(spec, argv, stdio=stdio, monitor="terminate", options=options)
