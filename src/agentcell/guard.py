"""The run protocol's protected-path step, apart from :mod:`agentcell.supervise` so that a cell run
through the warm launcher (which has no Supervised here) takes the same step: ``agentcell run``'s warm
path imports this, not the launcher."""
from __future__ import annotations

from .cell.spec import TYPE_CHECKING, CellSpec

if TYPE_CHECKING:
    from typing import Any


class Guard:
    """The run protocol's protected-path step. What could not be bound read-only in the cell (it did
    not exist, or lives in .git where git must write) is compared instead: what the command created on
    the control surface is moved aside (to a quarantine box given to ``give_to``, the human), what it
    changed or removed is reported. :meth:`check` adds ``quarantined`` (path: where it went),
    ``protected_changes``, ``protected_created`` (created and not moved) and ``scan_truncated``."""

    def __init__(self, spec: CellSpec, give_to: tuple[int, int] | None = None) -> None:
        import time

        from .cell import protect

        self.spec, self.give_to = spec, give_to
        self.since_ns = time.time_ns() - 100_000_000  # file times are coarse (a tick or so): some slack
        self.before, self.truncated = protect.surface(spec.rw_paths)

    def check(self, result: dict[str, Any], cell_id: str) -> dict[str, Any]:
        from .cell import protect

        spec = self.spec
        after, truncated = protect.surface(spec.rw_paths)
        moved, stuck = protect.quarantine(
            self.before, after, cell_id, spec.rw_paths, allow_write=spec.allow_write,
            keep_out=(*spec.ro_paths, *spec.masked_paths),
            owner_uid=None if spec.identity.userns else spec.identity.uid, since_ns=self.since_ns,
            before_truncated=self.truncated, give_to=self.give_to)
        gone = {old for old, _new in moved}
        result["quarantined"] = {old: new for old, new in moved}
        result["protected_changes"] = [
            p for p in protect.changes(self.before, after)
            if not any(p == a or p.startswith(a + "/") for a in spec.allow_write)]
        result["protected_created"] = [p for p in result["protected_changes"] if p not in gone and (
            p in stuck or p not in self.before) and not any(a in gone for a in protect._ancestors(p))]
        result["scan_truncated"] = truncated or self.truncated
        return result


def human() -> tuple[int, int] | None:
    """Who gets the quarantine box: the human behind sudo (so they can review it without root)."""
    import os

    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    if os.geteuid() == 0 and uid.isdigit() and gid.isdigit() and int(uid) != 0:
        return int(uid), int(gid)
    return None
