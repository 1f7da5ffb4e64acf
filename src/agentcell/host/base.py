"""``CellHost``: the one interface through which a cell is started, whoever serves it.

Three hosts implement it: :class:`agentcell.host.inprocess.InProcess` (the supervisor,
:class:`agentcell.supervise.Supervised`, in this process: for single-threaded callers, ``agentcell
run``'s cold path and the cell host itself),
:class:`agentcell.host.remote.RemoteHost` (a launcher or a cell host of ours, over the wire: for
threaded programs, ``agentcell run``'s warm path and the session) and
:class:`agentcell.host.fake.FakeHost` (no kernel: a script says what each command does, for tests of
what is built on top). A host's :meth:`CellHost.start` gives a :class:`CellHandle`; its
:meth:`CellHost.open` a :class:`LiveHandle` (a cell that stays up and runs many commands).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import CellEnded

if TYPE_CHECKING:
    import queue

    from ..cell.spec import CellSpec


@dataclass(frozen=True)
class StartOptions:
    """What a session hands the cell's host beside the spec. ``dedicated``: the cell's account exists for
    agents alone (None: as :meth:`Supervised.start` decides); ``guard``: the host runs the protected-path
    step (else the caller does); ``firewall``: a host-firewall table and its log reader made before, which
    the host adopts and removes with the cell (the caller closes its copy of the reader once the cell has
    started); ``credentials`` (:class:`agentcell.network.credentials.CredentialSet`): injected by the
    cell's proxy; ``upstream_ca``: a PEM the proxy trusts upstream (a test's stand-in for public CAs);
    ``session``: the cell is a session's, which the host holds against ``session recover`` (:mod:`.owner`)."""

    dedicated: bool | None = None
    guard: bool = False
    firewall: tuple[Any, Any] | None = None
    credentials: Any = None
    upstream_ca: str | None = None
    session: bool = False

    def wire(self) -> dict[str, Any]:
        """The request's keys (the secrets' values go over the socket: never argv, never a file)."""
        out: dict[str, Any] = {"guard": self.guard}
        if self.session:
            out["session"] = True
        if self.dedicated is not None:
            out["dedicated"] = self.dedicated
        if self.credentials is not None and self.credentials.secrets:
            out["credentials"] = self.credentials.as_wire()
            out["upstream_ca"] = self.upstream_ca
        if self.firewall is not None:
            fw, log = self.firewall
            out["firewall"] = {"table": fw.table, "record": fw.record, "group": log.group}
        return out

    def beside(self) -> bool:
        """Whether something lives beside the cell (then a cell host serves it)."""
        return self.dedicated is not None or self.firewall is not None or bool(
            self.credentials is not None and self.credentials.secrets)

    def fds(self) -> list[int]:
        return [self.firewall[1].sock.fileno()] if self.firewall is not None else []


class CellHandle(Protocol):
    """A cell running one command. ``events()`` are the monitor's, as dicts; ``poll()`` the result once
    it has ended (the dict ``agentcell run --json`` prints), ``wait(timeout)`` waits for it (killing the
    command at ``timeout``: status 124); ``settle(timeout)`` waits up to ``timeout`` seconds for news (an
event, stats, the end: a watcher's pause that ends as soon as there is something to see);
``terminate(reason)`` freezes and kills the cell."""

    cell_id: str
    pid1: int

    def events(self) -> list[dict[str, Any]]: ...

    def stats(self) -> dict[str, Any]: ...

    def poll(self) -> dict[str, Any] | None: ...

    def wait(self, timeout: float | None = None) -> dict[str, Any]: ...

    def settle(self, timeout: float) -> None: ...

    def signal(self, sig: int) -> None: ...

    def terminate(self, reason: str) -> None: ...

    @property
    def lost(self) -> bool: ...


class LiveHandle(Protocol):
    """A live cell: ``exec`` starts a command on the fds given and returns its id and the queue its end
    comes to (``{"event": "exit", ...}``, ``error``, or ``lost`` once the cell has ended); ``ended`` says
    why the cell ended (None while it runs), ``result`` is its result once it has."""

    cell_id: str
    pid1: int
    ended: str | None
    result: dict[str, Any] | None

    def events(self) -> list[dict[str, Any]]: ...

    def exec(self, argv: list[str], fds: Sequence[int], *, env: dict[str, str], cwd: str | None,
             timeout: float | None) -> tuple[int, queue.SimpleQueue[dict[str, Any]]]: ...

    def signal(self, cid: int, sig: int) -> None: ...

    def forget(self, cid: int) -> None: ...

    def close(self, timeout: float | None = 30.0) -> dict[str, Any] | None: ...


class CellHost(Protocol):
    def start(self, spec: CellSpec, argv: Sequence[str], *, stdio: Sequence[int] = (0, 1, 2),
              monitor: str | None = None, options: StartOptions | None = None) -> CellHandle: ...

    def open(self, spec: CellSpec, *, monitor: str | None = "terminate") -> LiveHandle: ...

    def close(self) -> None: ...


__all__ = ["CellEnded", "CellHandle", "CellHost", "LiveHandle", "StartOptions"]
