"""Toolchain caches that outlive a session without opening the human's home.

Without them every session starts cold: pip, npm, cargo and go find empty caches in the cell's fresh home
and fetch every dependency again through the proxy. So each project (and, for a persistent agent,
each agent on each project) has a cache tree in agentcell's own store, bound read-write at ``/cache``
in the cell, with each toolchain pointed into it (:data:`TOOLS`)::

    <state dir>/caches/                     0700, agentcell's (root's: /var/lib/agentcell; else XDG state)
    <state dir>/caches/<key>/               0700: meta.json (the project, the agent, when last used)
    <state dir>/caches/<key>/tree/          at /cache in the cell, owned by the account the session runs as

What this keeps and why:

* **Never the human's ~/.cache.** A cache the agent writes is one the next user of it executes from
  (a wheel, a tarball's install script, a build artefact): the human's own caches never enter a cell,
  and a cell's never leaves the store.
* **Never shared across a trust boundary.** The key is the project's real path and the uid that owns
  it, plus the agent's name for ``--agent``: a cache one agent poisoned on one project is seen by the
  next session of that agent on that project and by nothing else.
* **Ownership follows the session.** A per-session account is new each time: at spawn, what is in the
  tree is handed to it (fchown of the opened file, setuid/setgid bits and write-for-others dropped, as
  :func:`agentcell.accounts.acl.reassign` does for the project); at cleanup, what it made goes back to
  root before its uid is freed, so the number's next owner finds nothing of its. A regular file with
  more than one link is never handed over: it may be a host file the agent hard-linked in.
* The variables are set only where the session does not set them itself (``--env``).

``agentcell cache list`` shows the store; ``agentcell cache clear`` empties a project's (or all).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Callable
from typing import Any

from . import hostfs
from .cell.spec import CACHE_PATH
from .errors import AgentcellError

# toolchain -> (its directory in the tree, the variables that point it there)
TOOLS: dict[str, tuple[str, tuple[str, ...]]] = {
    "pip": ("pip", ("PIP_CACHE_DIR",)),
    "uv": ("uv", ("UV_CACHE_DIR",)),
    "npm": ("npm", ("npm_config_cache",)),
    "pnpm": ("pnpm", ("pnpm_config_store_dir",)),  # pnpm 11 (older ones: store-dir in .npmrc)
    "yarn": ("yarn", ("YARN_CACHE_FOLDER",)),
    "cargo": ("cargo", ("CARGO_HOME",)),  # the registry and git checkouts; cargo install's bin/ too
    "go-mod": ("go/mod", ("GOMODCACHE",)),
    "go-build": ("go/build", ("GOCACHE",)),
}
# Settings the toolchains need beside the path: /cache is a mount of its own, so uv's default (hard
# links from its cache into the project) fails on every install (EXDEV) and warns before it copies. A
# copy is also what keeps the cache apart from the project: a file linked into both would carry an
# edit of the project's copy back into the cache the next session installs from.
SETTINGS = {"UV_LINK_MODE": "copy"}
META = "meta.json"
TREE = "tree"


def store() -> str:
    return os.path.join(hostfs.state_dir(), "caches")


def _slug(path: str) -> str:
    base = os.path.basename(path.rstrip("/")) or "root"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", base.encode("utf-8", "surrogateescape").decode("ascii", "replace"))[:32]


def key(project: str, agent: str | None) -> str:
    """The store entry of ``project`` (its real path, and the uid that owns it); ``agent``: a
    persistent agent's own entry for it."""
    real = os.path.realpath(project)
    try:
        owner = os.stat(real).st_uid
    except OSError:
        owner = -1
    digest = hashlib.sha256(b"\0".join([os.fsencode(real), str(owner).encode(), (agent or "").encode()])
                            ).hexdigest()[:16]
    return f"{agent + '--' if agent else ''}{_slug(real)}-{digest}"


def tree_of(project: str, agent: str | None) -> str:
    return os.path.join(store(), key(project, agent), TREE)


def environment(given: dict[str, str] | None = None) -> dict[str, str]:
    """What points each toolchain at /cache, less what ``given`` (the session's own) already sets."""
    given = given or {}
    out: dict[str, str] = {}
    for sub, names in TOOLS.values():
        for name in names:
            if name not in given:
                out[name] = f"{CACHE_PATH}/{sub}"
    out.update({k: v for k, v in SETTINGS.items() if k not in given})
    return out


def prepare(project: str, agent: str | None, owner: tuple[int, int],
            handover: Callable[[str, int, int], list[str]] | None = None) -> tuple[str, list[str]]:
    """The tree of this project's cache, made if new, its entries handed to ``owner`` (uid, gid)
    unless it runs as us. Returns (the tree, what could not be handed over)."""
    hostfs.private_dir(store(), "cache")
    tree = tree_of(project, agent)
    entry = hostfs.private_dir(os.path.dirname(tree), "cache")
    try:
        os.mkdir(tree, 0o700)
    except FileExistsError:
        pass
    meta = read_meta(entry)
    now = time.time()
    meta.update({"project": os.path.realpath(project), "agent": agent,
                 "created": meta.get("created", now), "last_used": now, "owner": list(owner)})
    hostfs.replace_file(os.path.join(entry, META), json.dumps(meta, indent=1).encode() + b"\n")
    left: list[str] = []
    if owner[0] != os.geteuid() or owner[1] != os.getegid():
        left = (handover or hand_over)(tree, owner[0], owner[1])
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for sub, _ in TOOLS.values():
            _mkdirs(fd, sub, owner)
    finally:
        os.close(fd)
    return tree, left


def _mkdirs(top: int, rel: str, owner: tuple[int, int]) -> None:
    """``rel`` below the directory ``top``, each component made by us (mode 0700) and given to
    ``owner``; a component that is not a directory (a link the agent left) is left alone."""
    fd = os.dup(top)
    try:
        for part in rel.split("/"):
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                return
            os.close(fd)
            fd = nfd
            st = os.fstat(fd)
            if (st.st_uid, st.st_gid) != owner:
                os.fchown(fd, *owner)
    finally:
        os.close(fd)


def hand_over(tree: str, uid: int, gid: int) -> list[str]:
    """Give every entry of ``tree`` not already ``uid:gid``'s to it, as reassign does (no
    setuid/setgid bit, not writable by others, no ACL entry naming anyone); regular files with other
    links stay as they are.
    Returns what was left (a few, described)."""
    from .accounts.acl import Walk, give

    linked = []
    for n in Walk(tree, links=True):
        if n.st.st_uid == uid and n.st.st_gid == gid:
            continue
        if stat.S_ISREG(n.st.st_mode) and n.st.st_nlink > 1:
            linked.append(n.rel)
            continue
        give(n, uid, gid)  # no one else's way in, whoever wrote it there
    return [f"{os.path.join(tree, r)} has other links: not handed to the session" for r in linked[:3]] + \
        ([f"... and {len(linked) - 3} more"] if len(linked) > 3 else [])


def read_meta(entry: str) -> dict[str, Any]:
    try:
        data = hostfs.read_regular(os.path.join(entry, META), "cache", "agentcell cache clear removes it")
        meta = json.loads(data)
        return meta if isinstance(meta, dict) else {}
    except (AgentcellError, ValueError):
        return {}


def _size(tree: str) -> int | None:
    """Bytes on disk below ``tree`` (None: it could not be walked); iterative, never a link followed."""
    from .accounts.acl import Walk

    try:
        return sum(n.st.st_blocks * 512 for n in Walk(tree, links=True) if stat.S_ISREG(n.st.st_mode))
    except (OSError, AgentcellError):
        return None


def entries() -> list[dict[str, Any]]:
    """The store, one dict per project cache: key, path, project, agent, owner, size, last used."""
    top = store()
    try:
        names = sorted(os.listdir(top))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        entry = os.path.join(top, name)
        if not os.path.isdir(entry) or os.path.islink(entry):
            continue
        meta = read_meta(entry)
        tree = os.path.join(entry, TREE)
        try:
            st = os.lstat(tree)
            owner = f"{st.st_uid}:{st.st_gid}"
        except OSError:
            owner = "-"
        out.append({"key": name, "path": tree, "project": meta.get("project"), "agent": meta.get("agent"),
                    "owner": owner, "bytes": _size(tree),
                    "tools": sorted(t for t, (sub, _) in TOOLS.items() if _nonempty(os.path.join(tree, sub))),
                    "last_used": meta.get("last_used")})
    return out


def _nonempty(d: str) -> bool:
    try:
        return any(True for _ in os.scandir(d))
    except OSError:
        return False


def clear(which: list[dict[str, Any]]) -> list[str]:
    """Remove these entries (as :func:`entries` gives them); returns the paths removed."""
    removed = []
    for e in which:
        entry = os.path.dirname(e["path"])
        _remove(entry)
        removed.append(entry)
    return removed


def discard(tree: str) -> None:
    """Remove the entry of ``tree`` (a session ended at an escape wrote there)."""
    _remove(os.path.dirname(tree))


def _remove(path: str) -> None:
    """Remove a store entry, however deep or read-only the toolchains made it (go's module cache is
    0555): coreutils' rm and chmod walk iteratively, stay on one file system and follow no link."""
    import subprocess

    if not os.path.lexists(path):
        return
    if os.geteuid() != 0:  # root needs no write permission to remove; a user does
        subprocess.run(["chmod", "-R", "u+rwX", "--", path], capture_output=True, check=False)
    p = subprocess.run(["rm", "-rf", "--one-file-system", "--", path], capture_output=True, text=True)
    if p.returncode != 0 or os.path.lexists(path):
        raise AgentcellError("cache", f"{hostfs.shown(path)} could not be removed: "
                             f"{p.stderr.strip().splitlines()[-1] if p.stderr.strip() else 'still there'}",
                             "remove it by hand (as root for root's sessions)")
