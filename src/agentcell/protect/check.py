"""The run protocol's protected-path step: the control surface compared before and after a run, what
the command created there moved aside (quarantined), what it changed reported. Apart from
:mod:`agentcell.supervise` so that a cell run through the warm launcher (which has no Supervised here)
takes the same step: ``agentcell run``'s warm path imports this, not the launcher."""
from __future__ import annotations

import os
import stat

from ..cell import paths
from ..cell.spec import TYPE_CHECKING, CellSpec
from ..errors import LaunchError
from . import surface
from .surface import QUARANTINE_DIR, STRUCTURE

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

MAX_QUARANTINE = 200_000  # the scan's limits bound it anyway (5000 directories, ~40 names each)


class SurfaceCheck:
    """The run protocol's protected-path step. What could not be bound read-only in the cell (it did
    not exist, or lives in .git where git must write) is compared instead: what the command created on
    the control surface is moved aside (to a quarantine box given to ``give_to``, the human), what it
    changed or removed is reported, with what the change means (:func:`.surface.describe`: a git
    setting, a hook, a driver line; git's ordinary work on objects, refs and the index is none of it).
    :meth:`check` adds ``quarantined`` (path: where it went), ``protected_changes``, ``protected_created``
    (created and not moved), ``protected_described`` (path: what changed) and ``scan_truncated``."""

    def __init__(self, spec: CellSpec, give_to: tuple[int, int] | None = None) -> None:
        import time

        self.spec, self.give_to = spec, give_to
        self.since_ns = time.time_ns() - 100_000_000  # file times are coarse (a tick or so): some slack
        self.before, self.truncated = surface.surface(spec.rw_paths)
        self.meant = surface.meanings(self.before)

    def check(self, result: dict[str, Any], cell_id: str) -> dict[str, Any]:
        spec = self.spec
        result.update(compare(self.before, self.truncated, self.since_ns, cell_id, spec.rw_paths, spec.allow_write,
                              (*spec.ro_paths, *spec.masked_paths),
                              None if spec.identity.userns else spec.identity.uid, self.give_to, self.meant))
        return result


def compare(before: dict[str, Any], before_truncated: bool, since_ns: int, cell_id: str, rw_paths: tuple[str, ...],
            allow_write: tuple[str, ...], keep_out: tuple[str, ...], owner_uid: int | None,
            give_to: tuple[int, int] | None, meant_before: dict[str, str] | None = None, *,
            owner_only: bool = False) -> dict[str, Any]:
    """The step's second half, once the cell has ended, from its first half's scan (``before`` and
    what its files meant, ``meant_before``, kept by :class:`SurfaceCheck`, or in a session's checkpointed
    state): ``quarantined`` (path: where it went), ``protected_changes``, ``protected_created`` (created
    and not moved), ``protected_described`` (path: what changed there; under an --allow-write path too,
    which the human lifted: it is still said) and ``scan_truncated``. ``owner_only``: see :func:`quarantine`."""
    after, truncated = surface.surface(rw_paths)
    moved, stuck = quarantine(before, after, cell_id, rw_paths, allow_write=allow_write, keep_out=keep_out,
                                      owner_uid=owner_uid, since_ns=since_ns, before_truncated=before_truncated,
                                      give_to=give_to, owner_only=owner_only)
    gone = {old for old, _new in moved}
    changes = surface.changes(before, after, meant_before)
    created = [p for p in changes if p not in gone and (p in stuck or p not in before)
               and not any(a in gone for a in _ancestors(p))]
    described = {p: surface.describe(p, (meant_before or {}).get(p), surface.meaning(p))
                 for p in changes if p not in gone and not any(a in gone for a in _ancestors(p))}
    return {"quarantined": {old: new for old, new in moved}, "protected_changes": changes,
            "protected_created": created, "protected_described": described,
            "scan_truncated": truncated or before_truncated}


def protected_lines(result: dict[str, Any]) -> list[str]:
    """What a command's protected-path step found, as warnings (the CLI's, a live cell's stop, the notes of
    a start that failed once its command was let go)."""
    out = lines(result, "the command", lift_hint=True)
    if result.get("scan_truncated"):
        out.append(f"the writable paths hold more than the protected-path scan covers ({surface.MAX_DEPTH} levels, "
                   f"{surface.MAX_DIRS} directories): repositories and agent config past that were neither protected "
                   "nor checked; review them before you use them")
    return out


def lines(found: dict[str, Any], who: str, *, lift_hint: bool) -> list[str]:
    """The step's findings (:func:`compare`) as warnings: what ``who`` ("the command", "the agent")
    created and where it went, what it changed and how; ``lift_hint``: say how to let a command create
    an entry (agentcell run's --allow-write)."""
    from ..errors import printable

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
    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    if os.geteuid() == 0 and uid.isdigit() and gid.isdigit() and int(uid) != 0:
        return int(uid), int(gid)
    return None


def quarantine(before: dict[str, tuple[int, int, int, int]], after: dict[str, tuple[int, int, int, int]],
               cell_id: str, writable: tuple[str, ...], *, allow_write: tuple[str, ...] = (),
               keep_out: tuple[str, ...] = (), owner_uid: int | None = None, since_ns: int = 0,
               before_truncated: bool = False, give_to: tuple[int, int] | None = None,
               owner_only: bool = False) -> tuple[list[tuple[str, str]], list[str]]:
    """Move aside what the run created on the control surface; ([(path, new path)], [not moved]).

    Called when the cell has ended (its processes are gone), as root possibly, on a tree an agent
    wrote. An entry moves only if it is part of the structure (a name in STRUCTURE: never a file a
    config merely points at), came into being during the run (its ctime, which no one but root can
    set back, is not before ``since_ns``), did not exist before (when the before-scan was cut short
    that is not known: then only a cell with a uid of its own can be trusted to have made what that
    uid owns), is not lifted by --allow-write nor inside a ``keep_out`` path (--ro, --mask), and —
    when the cell ran as a uid of its own — is owned by that uid: nothing of the user's moves.

    It goes into ``<writable root>/.agentcell-quarantine-<cell id>-<random>/`` (made here, 0700,
    ``give_to``'s), by a rename relative to directory fds that follows no symlink and replaces
    nothing; the entry must still be the one the scan saw. An entry below one already moved went
    with it. ``owner_only``: the run's end is not known (a session finished by ``session recover``: the human
    may have worked there since), so only what ``owner_uid`` owns moves, as with a cut short scan."""
    lifted = tuple(a.rstrip("/") for a in allow_write)
    fences = tuple(k.rstrip("/") for k in keep_out)
    by_owner = before_truncated or owner_only
    if by_owner and owner_uid is None:
        return [], []
    # With a complete before-scan, anything structural that is new and born during the run moves,
    # whoever owns it (a directory of the user's the agent renamed into .claude, say); only a cut
    # short scan, or a run whose end is not known, needs the owner to tell the cell's work from the rest.
    owner_uid = owner_uid if by_owner else None
    created = sorted(p for p in after if (p not in before or before_truncated) and os.path.basename(p) in STRUCTURE
                     and not any(p == a or p.startswith(a + "/") for a in lifted)
                     and not any(p == k or p.startswith(k + "/") for k in fences))
    return _move_all([(p, after[p]) for p in created], cell_id, writable, owner_uid, since_ns, give_to)


def set_aside(paths: list[str], cell_id: str, writable: tuple[str, ...], *, owner_uid: int | None, since_ns: int,
              give_to: tuple[int, int] | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """Move ``paths`` (files a run created that the next run or the human's tools would load: an env
    file, a session's config) into the run's quarantine box, as :func:`quarantine` moves structure: only
    what came into being during the run (ctime), owned by ``owner_uid`` when given, by a rename that
    follows no link. ([(path, new path)], [not moved])."""
    seen = []
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        seen.append((path, (stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns)))
    return _move_all(seen, cell_id, writable, owner_uid, since_ns, give_to)


def _move_all(entries: list[tuple[str, tuple[int, int, int, int]]], cell_id: str, writable: tuple[str, ...],
              owner_uid: int | None, since_ns: int, give_to: tuple[int, int] | None
              ) -> tuple[list[tuple[str, str]], list[str]]:
    """Each (path, what the scan saw of it) into the quarantine box of its writable root (made when a
    first one moves); an entry below one already moved went with it."""
    moved: list[tuple[str, str]] = []
    gone: set[str] = set()
    failed: list[str] = []
    boxes: dict[str, tuple[int, str]] = {}
    try:
        for path, seen in entries:
            if any(a in gone for a in _ancestors(path)):
                continue
            root = next((r for r in writable if path.startswith(r.rstrip("/") + "/")), None)
            if root is None or len(moved) >= MAX_QUARANTINE:
                failed.append(path)
                continue

            def box(root: str = root) -> tuple[int, str]:
                if root not in boxes:
                    boxes[root] = _quarantine_box(root, cell_id, give_to)
                return boxes[root]
            try:
                new = _move(path, seen, owner_uid, since_ns, box, os.path.relpath(path, root))
            except (OSError, LaunchError, ValueError):
                failed.append(path)
                continue
            if new is None:
                continue  # not the cell's: left where it is (and reported as a change)
            moved.append((path, os.path.join(root, new)))
            gone.add(path)
    finally:
        for fd, _name in boxes.values():
            os.close(fd)
    return moved, failed


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(2, len(parts))]


def _quarantine_box(root: str, cell_id: str, give_to: tuple[int, int] | None = None) -> tuple[int, str]:
    """A new directory ``<root>/.agentcell-quarantine-<cell id>-<random>`` (0700), its fd and name.
    A new, unguessable name per run: nothing the agent made beforehand can stand in its way. It
    belongs to ``give_to`` (the human behind sudo) when given, so they can review it without root."""
    name = f"{QUARANTINE_DIR}-{cell_id}-{os.urandom(4).hex()}"
    rfd = paths.open_nofollow(root)
    try:
        os.mkdir(name, 0o700, dir_fd=rfd)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
    finally:
        os.close(rfd)
    if give_to is not None:
        try:
            os.chown(fd, *give_to)
        except BaseException:
            os.close(fd)
            raise
    return fd, name


def _move(path: str, seen: tuple[int, int, int, int], owner_uid: int | None, since_ns: int,
          box_of: Callable[[], tuple[int, str]], rel: str) -> str | None:
    """Rename ``path`` into ``box`` as its relative path with ``/`` spelled ``%2F``; the new name under
    the quarantine dir, or None when the entry is not the cell's. Raises OSError when it cannot move."""
    parent, name = os.path.split(path)
    pfd = paths.open_nofollow(parent)
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if (stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns) != seen:
            raise OSError("replaced since the scan")
        if (owner_uid is not None and st.st_uid != owner_uid) or st.st_ctime_ns < since_ns:
            return None
        box, box_name = box_of()  # made only when something is to move
        flat = rel.replace("%", "%25").replace("/", "%2F")
        if len(os.fsencode(flat)) > 200:  # too long for one name: keep its end, made unique
            flat = f"{os.urandom(4).hex()}-{flat[-150:]}"
        if os.path.lexists(f"/proc/self/fd/{box}/{flat}"):
            raise OSError("name taken")
        os.rename(name, flat, src_dir_fd=pfd, dst_dir_fd=box)
        return os.path.join(box_name, flat)
    finally:
        os.close(pfd)
