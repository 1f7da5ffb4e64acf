"""The ``landlock`` source: Landlock denials from the kernel's audit stream (:mod:`.kaudit`), those of
this cell's processes, as events with the flag that would allow each.

A denial is the cell's by the denying process's Landlock domain (the kernel's record of who made it, or
a first denial of it attributed) or by its descent from the cell's PID 1. Lost records (a full backlog,
an overflowed socket) are held against the cell only when it was itself being refused in a flood.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from .event import CellEvent
from .kaudit import AuditReader, audit_lost
from .procs import CellProcs

# An audit overflow is held against the cell that made it: at least FLOOD of its own Landlock denials, and
# at least half of all the host's, in the last FLOOD_S seconds (a busy cell among a flood is not the flood).
FLOOD = 50
FLOOD_S = 2.0
LOST_S = 1.0  # how often the kernel's count of dropped records is read

_BLOCKERS = {"fs.execute": "execute", "fs.read_file": "read", "fs.read_dir": "read", "net.bind_tcp": "network",
             "net.connect_tcp": "network", "scope.abstract_unix_socket": "network", "scope.signal": "execute"}


def landlock_event(raw: dict[str, Any], cell: str) -> CellEvent:
    """A completed Landlock denial (audit records) as a CellEvent, with the flag that would allow it."""
    ll, sc = raw.get("landlock", {}), raw.get("syscall", {})
    blockers = ll.get("blockers", "")
    op = next((v for k, v in _BLOCKERS.items() if blockers.startswith(k)), "write" if "fs." in blockers else "execute")
    if "daddr" in ll:
        target = f"{ll['daddr']}:{ll.get('dest', '?')}"
        allow = "--net loopback (a cell's own loopback) or --net proxy with --allow-domain"
    elif "path" in ll:
        target = ll["path"]
        allow = f"--ro {target}" if op in ("read", "execute") else f"--rw {target}"
    else:
        target, allow = ll.get("opid", blockers), ""
    pid = int(sc["pid"]) if sc.get("pid", "").isdigit() else None
    bind = blockers.startswith("net.bind_tcp")  # listening in a cell nothing outside can reach: noted only
    tuning = op == "write" and _tunes_itself(str(ll.get("path", "")))
    reason = f"blocked by Landlock ({blockers})"
    if tuning:  # one note per file, whichever process: they are alike
        target = "/proc/<pid>/" + target.rsplit("/", 1)[-1]
        reason += "; a process of the cell tuning itself (its OOM score, its name): refused, not held against it"
    return CellEvent(op, target, reason, source="landlock", cell=cell, pid=pid, exe=sc.get("exe", ""),
                     allow=allow, ts=raw.get("ts"), acts=not (bind or tuning))


# Files of a process's own /proc entry that runtimes write about themselves (node and its kin set their
# OOM score at start). The cell's /proc shows only its own processes, so the writer is the cell's.
_SELF_TUNING = frozenset({"oom_score_adj", "oom_adj", "comm", "timerslack_ns", "autogroup"})


def _tunes_itself(path: str) -> bool:
    parts = path.split("/")
    if len(parts) < 4 or parts[:2] != ["", "proc"] or parts[-1] not in _SELF_TUNING:
        return False
    who = parts[2:-1]
    if len(who) == 3 and who[1] == "task" and who[2].isdigit():  # /proc/PID/task/TID/comm
        who = who[:1]
    return len(who) == 1 and (who[0].isdigit() or who[0] in ("self", "thread-self"))


class LandlockSource:
    """``uid``: the cell's account; ``exclusive``: a session's own account, which runs nothing but this
    cell (then a domain its uid made is the cell's, with no fork seen)."""

    name = "landlock"

    def __init__(self, reader: AuditReader, procs: CellProcs, cell: str, uid: int | None, exclusive: bool,
                 progress: Callable[[], None]) -> None:
        self.reader, self.procs, self.cell, self.uid, self.exclusive = reader, procs, cell, uid, exclusive
        reader.on_read = progress
        self._domains: set[str] = set()
        # Landlock denials the host reported lately: (when, whether this cell's); as many as the audit backlog
        self._denials: collections.deque[tuple[float, bool]] = collections.deque(maxlen=8192)
        self._checked = time.monotonic()
        try:
            self._lost: int | None = audit_lost()
        except OSError:
            self._lost = None

    def fileno(self) -> int:
        return self.reader.fileno()

    def read(self) -> list[CellEvent]:
        out = []
        for raw in self.reader.read(accept=self._accept):
            if raw.get("lost"):
                out.append(self._overflow("the audit stream overflowed"))
            elif self._ours(raw):
                out.append(landlock_event(raw, self.cell))
        if time.monotonic() - self._checked >= LOST_S:
            self._checked = time.monotonic()
            out += self._dropped()
        return out

    def close(self) -> None:
        self.reader.close()

    def _our_domain(self, domain: str) -> bool:
        """Whether the kernel's record of ``domain`` says the cell made it: for a session's own account
        (it runs nothing but this cell), made by that account. No fork needs to have been seen, so a
        flood of the proc connector cannot hide a denial. Not by the maker's pid: the record is
        written at the domain's first denial, long after, and the number may be another process's by
        then (an outsider could have a cell's new process take it). Not for a persistent agent's
        account, which may run two cells at once, nor for a person's uid."""
        maker = self.reader.domains.get(domain) if self.exclusive else None
        if maker is None or maker[1] != self.uid:
            return False
        if len(self._domains) < 4096:
            self._domains.add(domain)
        return True

    def _ours(self, raw: dict[str, Any]) -> bool:
        """Is the denying process one of this cell's? Its Landlock domain says so (the kernel's record
        of who made it, or a first denial of it attributed); its descent from PID 1 says so too."""
        domain = raw.get("landlock", {}).get("domain", "")
        if domain in self._domains or self._our_domain(domain):
            return True
        pid = raw.get("syscall", {}).get("pid", "")
        if pid.isdigit() and int(pid) in self.procs.members:  # by descent: a process that is already gone counts
            self._domains.add(domain)
            return True
        return False

    def _accept(self, pid: int, domain: str) -> bool:
        """A Landlock denial worth parsing: by one of the cell's processes (or its domain). A process
        forked after the connector was last read is looked up after reading it again."""
        ours = pid in self.procs.members or domain in self._domains or self._our_domain(domain)
        if not ours:
            self.procs.refresh()
            ours = pid in self.procs.members
        self._denials.append((time.monotonic(), ours))
        return ours

    def _dropped(self) -> list[CellEvent]:
        """Records the kernel dropped before anyone could read them (its backlog was full). Host-wide,
        so noted, not held against the cell: a denial may be missing from the report, never allowed."""
        try:
            lost = audit_lost()
        except OSError:
            return []
        before, self._lost = self._lost, lost
        if before is not None and lost > before:
            return [self._overflow("the kernel dropped audit records (its backlog was full)")]
        return []

    def _overflow(self, what: str) -> CellEvent:
        """Lost Landlock records. If this cell was itself making Landlock refuse things just now, it may
        have flooded the stream to hide one attempt among them: that ends it like any attempt. If it
        was quiet, the host's other Landlock users did it: noted, not held against the cell (a denial
        may be missing from the report; the kernel still refused it)."""
        # A flood of its own, not the odd refusal (a runtime setting its OOM score): another cell's flood,
        # or another user's, must not end this one.
        since = time.monotonic() - FLOOD_S
        recent = [ours for t, ours in self._denials if t >= since]
        mine = sum(recent)
        busy = mine >= FLOOD and 2 * mine >= len(recent)
        return CellEvent("telemetry", "landlock", f"{what}: a Landlock denial may be missing from this report"
                         + (" while the cell itself was being refused" if busy else " (the kernel still refused it)"),
                         source="telemetry", cell=self.cell, acts=busy)
