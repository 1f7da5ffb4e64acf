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
    changed or removed is reported, with what the change means (:func:`agentcell.protect.describe`: a git
    setting, a hook, a driver line; git's ordinary work on objects, refs and the index is none of it).
    :meth:`check` adds ``quarantined`` (path: where it went), ``protected_changes``, ``protected_created``
    (created and not moved), ``protected_described`` (path: what changed) and ``scan_truncated``."""

    def __init__(self, spec: CellSpec, give_to: tuple[int, int] | None = None) -> None:
        import time

        from . import protect

        self.spec, self.give_to = spec, give_to
        self.since_ns = time.time_ns() - 100_000_000  # file times are coarse (a tick or so): some slack
        self.before, self.truncated = protect.surface(spec.rw_paths)
        self.meant = protect.meanings(self.before)

    def check(self, result: dict[str, Any], cell_id: str) -> dict[str, Any]:
        spec = self.spec
        result.update(compare(self.before, self.truncated, self.since_ns, cell_id, spec.rw_paths, spec.allow_write,
                              (*spec.ro_paths, *spec.masked_paths),
                              None if spec.identity.userns else spec.identity.uid, self.give_to, self.meant))
        return result


def compare(before: dict[str, Any], before_truncated: bool, since_ns: int, cell_id: str, rw_paths: tuple[str, ...],
            allow_write: tuple[str, ...], keep_out: tuple[str, ...], owner_uid: int | None,
            give_to: tuple[int, int] | None, meant_before: dict[str, str] | None = None) -> dict[str, Any]:
    """The step's second half, once the cell has ended, from its first half's scan (``before`` and
    what its files meant, ``meant_before``, kept by :class:`Guard`, or in a session's checkpointed
    state): ``quarantined`` (path: where it went), ``protected_changes``, ``protected_created`` (created
    and not moved), ``protected_described`` (path: what changed there; under an --allow-write path too,
    which the human lifted: it is still said) and ``scan_truncated``."""
    from . import protect

    after, truncated = protect.surface(rw_paths)
    moved, stuck = protect.quarantine(before, after, cell_id, rw_paths, allow_write=allow_write, keep_out=keep_out,
                                      owner_uid=owner_uid, since_ns=since_ns, before_truncated=before_truncated,
                                      give_to=give_to)
    gone = {old for old, _new in moved}
    changes = protect.changes(before, after, meant_before)
    created = [p for p in changes if p not in gone and (p in stuck or p not in before)
               and not any(a in gone for a in protect._ancestors(p))]
    described = {p: protect.describe(p, (meant_before or {}).get(p), protect.meaning(p))
                 for p in changes if p not in gone and not any(a in gone for a in protect._ancestors(p))}
    return {"quarantined": {old: new for old, new in moved}, "protected_changes": changes,
            "protected_created": created, "protected_described": described,
            "scan_truncated": truncated or before_truncated}


def lines(found: dict[str, Any], who: str, *, lift_hint: bool) -> list[str]:
    """The step's findings (:func:`compare`) as warnings: what ``who`` ("the command", "the agent")
    created and where it went, what it changed and how; ``lift_hint``: say how to let a command create
    an entry (agentcell run's --allow-write)."""
    from .errors import printable

    moved = found.get("quarantined") or {}
    out = [f"{who} created {printable(old)}, which decides what git, your shell or your agent runs; it was moved "
           f"to {printable(new)}" + (f" (do not run git or your agent inside it; to let a command create it, use "
                                     f"--allow-write {printable(old)})" if lift_hint else "")
           for old, new in moved.items()]
    created = set(found.get("protected_created") or ())
    described = found.get("protected_described") or {}
    for p in found.get("protected_changes") or ():
        if p in moved or any(p.startswith(g + "/") for g in moved):
            continue
        what = described.get(p) or ""
        verb = "created" if p in created else "removed" if what == "removed" else "changed"
        detail = f" ({what})" if what not in ("", "created", "changed", "removed") else ""
        out.append(f"{who} {verb} {printable(p)}{detail}, which decides what git, your shell or your agent runs: "
                   "review it before you use the project")
    return out


def human() -> tuple[int, int] | None:
    """Who gets the quarantine box: the human behind sudo (so they can review it without root)."""
    import os

    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    if os.geteuid() == 0 and uid.isdigit() and gid.isdigit() and int(uid) != 0:
        return int(uid), int(gid)
    return None
