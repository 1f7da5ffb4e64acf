"""A session's entry in the store (``<state dir>/workspaces/<session>/``): its meta.json, the base's
names, the lock one apply or discard holds, the listing of entries, the audit trail's records."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from typing import Any

from .. import hostfs
from ..errors import AgentcellError

META = "meta.json"
BASE_NAMES = "base.names"  # every file's inode and name at the start (NUL-separated): what the base held


class WorkspaceError(AgentcellError):
    pass


def store() -> str:
    return os.path.join(hostfs.state_dir(), "workspaces")


def path_of(session: str) -> str:
    if not session or "/" in session or session.startswith("."):
        raise WorkspaceError("SESSION", f"{session!r} is not a session id", "'agentcell session list' names them")
    return os.path.join(store(), session)


def _cs(meta: dict[str, Any]) -> str:
    """The change set's directory (as the owner: where root bound it for them, see :func:`.owner.as_owner`)."""
    return str(meta.get("cs") or os.path.join(meta["dir"], "cs"))


def _upper(meta: dict[str, Any]) -> str:
    return os.path.join(_cs(meta), "upper")


def _made_dir(path: str, mode: int) -> None:
    """``path``, a directory of ours with ``mode``: made, or found as a real directory of ours."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise WorkspaceError("workspace", f"{hostfs.shown(path)} is not a directory of agentcell's",
                             "remove it (it was not made by agentcell)")
    os.chmod(path, mode)


def load(session: str) -> dict[str, Any]:
    d = path_of(session)
    try:
        with open(os.path.join(d, META)) as f:
            meta: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise WorkspaceError("SESSION", f"session {session} has no workspace (it ran in the project itself, or "
                             "it was discarded)", "'agentcell session list --unapplied' names those that "
                             "wait") from None
    meta["dir"] = d
    return meta


def _save(meta: dict[str, Any]) -> None:
    d = meta["dir"]
    tmp = os.path.join(d, META + ".tmp")
    with open(tmp, "w") as f:
        json.dump({k: v for k, v in meta.items() if k != "dir"}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, META))


def _write_names(path: str, names: dict[str, int]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(b"\0".join(b"%d\0%s" % (ino, os.fsencode(n)) for n, ino in names.items()))


def _base_names(meta: dict[str, Any]) -> dict[str, int]:
    """What the base held: path -> inode number."""
    if "base_names" in meta:  # (read by agentcell for the owner: see as_owner)
        return dict(meta["base_names"])
    try:
        with open(os.path.join(meta["dir"], BASE_NAMES), "rb") as f:
            parts = f.read().split(b"\0")
    except FileNotFoundError:
        return {}
    return {os.fsdecode(parts[i + 1]): int(parts[i]) for i in range(0, len(parts) - 1, 2)}


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One apply (or discard) at a time: two landing on one project at once would each check its
    conflicts against a tree the other is changing."""
    _made_dir(store(), 0o711)
    fd = os.open(os.path.join(store(), ".apply.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def listing(unapplied_only: bool = False) -> list[dict[str, Any]]:
    out = []
    try:
        names = sorted(os.listdir(store()))
    except FileNotFoundError:
        return []
    for n in names:
        try:
            meta = load(n)
        except (WorkspaceError, OSError, ValueError):
            continue
        if unapplied_only and meta["state"] != "open":
            continue
        out.append({"session": n, "project": meta["project"], "state": meta["state"], "created": meta["created"]})
    return out


def _record(meta: dict[str, Any], event: str, **details: Any) -> None:
    """A record outside any session (review, apply, discard): sealed at once on a sealed trail."""
    from ..audit.trail import AuditLog

    log = AuditLog(meta.get("trail"))
    log.append(event, session=meta["session"], project=meta["project"], **details)
    if problem := log.seal():
        import sys

        sys.stderr.write(f"agentcell: warning: {problem}; the heads wait on this host ('agentcell audit seal' "
                         "retries)\n")
