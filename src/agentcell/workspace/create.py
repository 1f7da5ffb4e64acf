"""A session's workspace at its start: the store entry, the base (its listing, the commit git's HEAD
names), and the hide layer of what the view leaves out (what git ignores, the masked paths)."""
from __future__ import annotations

import os
import stat
import time
from typing import Any

from ..cell.spec import Workspace
from .gitbranch import _git
from .store import BASE_NAMES, META, WorkspaceError, _made_dir, _save, _write_names, load, path_of, store
from .tree import WHITEOUT, _walk

CLOCK_REALTIME_COARSE = 5  # <linux/time.h>; not in Python's time module


def base_now() -> int:
    """The base's time: the coarse clock file times come from (a write after this has a ctime at or
    after it; one at the same tick counts as after: a false conflict, never a missed one)."""
    return time.clock_gettime_ns(CLOCK_REALTIME_COARSE)


def create(session: str, project: str, *, owner: tuple[int, int], account: tuple[int, int],
           include: list[str], masked: list[str], trail: str | None) -> Workspace:
    """The session's workspace: its store entry, and the layers for the cell (a
    :class:`~agentcell.cell.spec.Workspace`)."""
    base = base_now()
    os.makedirs(os.path.dirname(store()), 0o700, exist_ok=True)
    _made_dir(store(), 0o711)
    d = path_of(session)
    project = os.path.realpath(project)
    rootless = os.geteuid() != 0
    idmap = () if rootless or (owner[0], owner[1]) == (account[0], account[1]) else (*owner, *account)
    cs = os.path.join(d, "cs")
    upper, work, hide = (os.path.join(cs, n) for n in ("upper", "work", "hide"))
    if os.path.exists(os.path.join(d, META)):  # a retried spawn: the same workspace, whatever it holds already
        meta = load(session)
        return Workspace(project, upper, work, hide if meta["hidden"] else "", idmap, rootless)
    os.mkdir(d, 0o711)
    os.mkdir(cs, 0o700)
    st = os.stat(project)
    os.mkdir(upper, stat.S_IMODE(st.st_mode))
    os.mkdir(work, 0o700)
    os.mkdir(hide, 0o755)
    if not rootless:
        os.chown(cs, owner[0], owner[1])  # the change set is the owner's to review (upper: see give_back)
        os.chown(upper, account[0], account[1])  # the view's root is upper's: the account's, as the project is shown
    git = _git_base(project, owner)
    hidden = sorted(set(_ignored(project, owner, include) if git else []) | {_rel(project, m) for m in masked})
    for rel in hidden:
        _whiteout(hide, rel, project, None if rootless else account)
    _write_names(os.path.join(d, BASE_NAMES), _listing(project, set(hidden)))
    meta = {"session": session, "project": project, "owner": list(owner), "account": list(account),
            "base_ns": base, "git": git, "hidden": hidden, "include": include, "userxattr": rootless,
            "state": "open", "trail": trail, "created": time.time()}
    meta["dir"] = d
    _save(meta)
    return Workspace(project, upper, work, hide if hidden else "", idmap, rootless)


def _listing(project: str, hidden: set[str]) -> dict[str, int]:
    """Every non-directory in the project (not .git, not what the view hides, not past a mount) and its
    inode number: what the base held. From the directories alone (readdir gives the inode; no file is
    stat'ed): 20,000 files in about 12 ms. A file replaced since (a rename over it, a directory moved
    in its place) has another inode."""
    return {rel: e.inode() for rel, e in _walk(project, skip=lambda rel, e: rel in hidden or rel == ".git")
            if not e.is_dir(follow_symlinks=False)}


def _rel(project: str, path: str) -> str:
    return os.path.relpath(path, project)


def _whiteout(top: str, rel: str, project: str, account: tuple[int, int] | None) -> None:
    """A whiteout at ``rel`` in the hide layer. Its directories are what the view shows for the project's
    (the topmost layer that has a directory gives its owner and mode): the project's mode, the account's
    as the idmapped project shows them, so the agent can still write in a directory that holds a hidden
    entry."""
    cur = top
    for part in [p for p in os.path.dirname(rel).split("/") if p]:
        cur = os.path.join(cur, part)
        if not os.path.isdir(cur):
            there = os.lstat(os.path.join(project, os.path.relpath(cur, top)))
            os.mkdir(cur, 0o700)
            if account is not None:
                os.chown(cur, account[0], account[1])
            os.chmod(cur, stat.S_IMODE(there.st_mode) & 0o7777)
    os.mknod(os.path.join(top, rel), stat.S_IFCHR | 0o000, WHITEOUT)


def _git_base(project: str, owner: tuple[int, int]) -> dict[str, Any] | None:
    """The commit the session starts from (HEAD, as the human's git names it), or None: no repository."""
    if not os.path.isdir(os.path.join(project, ".git")):
        return None
    try:
        head = _git(project, owner, "rev-parse", "--verify", "-q", "HEAD").decode().strip()
    except WorkspaceError:
        head = ""  # a repository without a commit yet
    fmt = _git(project, owner, "rev-parse", "--show-object-format").decode().strip() or "sha1"
    return {"head": head, "object_format": fmt}


def _ignored(project: str, owner: tuple[int, int], include: list[str]) -> list[str]:
    """What git ignores in the project (a directory as one entry), less what ``include`` names."""
    out = _git(project, owner, "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory")
    wanted = [i.strip("/") for i in include]
    paths = []
    for raw in out.split(b"\0"):
        if not raw:
            continue
        rel = os.fsdecode(raw).rstrip("/")
        if rel == ".git" or rel.startswith(".git/"):
            continue
        if any(rel == w or w.startswith(rel + "/") or rel.startswith(w + "/") for w in wanted):
            if any(w.startswith(rel + "/") for w in wanted):  # a directory holding an included file: its rest stays
                paths += _ignored_inside(project, rel, wanted)
            continue
        paths.append(rel)
    return paths


def _ignored_inside(project: str, rel: str, wanted: list[str]) -> list[str]:
    """Entries of an ignored directory that hold no included path (so those stay hidden)."""
    out = []
    try:
        names = os.listdir(os.path.join(project, rel))
    except OSError:
        return []
    for n in names:
        sub = f"{rel}/{n}"
        if any(sub == w or sub.startswith(w + "/") for w in wanted):
            continue
        if any(w.startswith(sub + "/") for w in wanted):
            out += _ignored_inside(project, sub, wanted)
        else:
            out.append(sub)
    return out
