"""The egress layer's refusals (the proxy's, the host firewall's) as ``network`` events, each pinned on
the process that held the socket (:mod:`.sockets`) or, for the firewall, on the failed connect to that
very address that the failed-call source saw."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .event import CellEvent
from .procs import CellProcs

MAX_LOOKUPS = 200  # egress refusals attributed by a socket lookup, per cell


class Refusals:
    """What every egress source of one cell shares. ``dedicated``: the cell's account exists for agents
    alone (agent:NAME, a session's own): whatever its uid does on the host's network is the cell's. A
    person's uid (--as UID, sudo's caller) is not."""

    def __init__(self, procs: CellProcs, cell: str, dedicated: bool) -> None:
        self.procs, self.cell, self.dedicated = procs, cell, dedicated
        self._lookups = 0  # egress refusals attributed by a socket lookup so far
        self.refused_by: dict[str, int] = {}  # a firewall-refused address -> the process whose connect failed

    def events(self, refusals: list[dict[str, Any]]) -> list[CellEvent]:
        out = []
        for raw in refusals:
            reason = str(raw.get("reason", ""))
            allow = ""
            if "add " in reason:
                cut = reason.find("add ")
                allow = reason[cut + 4:].rstrip(")").removesuffix(" to allow it")
                reason = reason[:cut].rstrip(" ;:,(")
            source = str(raw.get("source", "egress"))
            # The proxy serves this cell alone. The host firewall matches the account's uid: its
            # refusal is the cell's when the account is an agent's own (nothing else runs as it);
            # for a person's uid it is recorded, not pinned on the cell.
            acts = (source != "nftables" or self.dedicated) and not raw.get("note")
            if source == "nftables" and not self.dedicated:
                reason += " (matched by a person's uid, which runs outside the cell too: not held against it)"
            elif raw.get("note"):
                reason += " (an allowed name: refused, not held against the cell)"
            target = str(raw.get("target", "?"))
            out.append(CellEvent("network", target, reason, source=source, cell=self.cell,
                                 pid=self._owner(raw, target), allow=allow, ts=raw.get("ts"), acts=acts))
        return out

    def refused(self, target: str, pid: int) -> None:
        """A connect of the cell's that the host firewall refused (the failed-call source, on the host's
        network): its process, for the firewall's record of the same packet that comes after it."""
        if len(self.refused_by) < 1000:
            self.refused_by.setdefault(target, pid)

    def _owner(self, raw: dict[str, Any], target: str) -> int | None:
        """The process a refusal was for: the proxy knows the client's port in the cell (whose socket is in
        the cell's network namespace, connected to the proxy's), the firewall the packet's source port on
        the host; else a failed connect to that very address (the failed-call source)."""
        from .sockets import owner

        # Each lookup reads the namespace's socket tables, which a flood of refusals grows: the first
        # MAX_LOOKUPS refusals are attributed (the first one is what ends a cell), later ones are not.
        self._lookups += 1
        if self._lookups > MAX_LOOKUPS:
            return self.refused_by.get(target) if raw.get("source") == "nftables" else None
        procs = self.procs
        members = sorted(procs.members - {procs.seed} - procs.trusted)
        if raw.get("source") == "proxy" and procs.seed:
            from ..cell.spec import PROXY_PORT

            return owner(procs.seed, "tcp", int(raw.get("peer_port") or 0), PROXY_PORT, members)
        if raw.get("source") == "nftables":
            pid = owner("self", str(raw.get("protocol", "tcp")), int(raw.get("sport") or 0), None, members)
            return pid or self.refused_by.get(target)
        return None


class EgressSource:
    """One egress source: ``poll()`` returns its refusals since the last call; ``bell`` (if any) is
    readable when it has some (then they are read at once, not on the next pass)."""

    name = "egress"

    def __init__(self, poll: Callable[[], list[dict[str, Any]]], bell: int | None, refusals: Refusals) -> None:
        self.poll, self.bell, self.refusals = poll, bell, refusals

    def fileno(self) -> int:
        return -1 if self.bell is None else self.bell

    def read(self) -> list[CellEvent]:
        return self.refusals.events(self.poll())

    def close(self) -> None:
        pass  # the proxy and the firewall's log are the supervisor's
