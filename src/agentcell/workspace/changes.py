"""What the agent changed: the change set's layer read against the base (``base.names`` and
``base_ns``) and the project as it is now, one entry per path, renames paired."""
from __future__ import annotations

import bisect
import os
import stat
from typing import Any

from .. import hostfs
from .store import _base_names, _upper
from .tree import _digest, _is_whiteout, _kind, _lstat, _walk, _walk_files


def marks(meta: dict[str, Any]) -> dict[str, list[str]]:
    """The directories overlayfs made opaque in the change set (the agent removed the project's and made
    its own), as paths. Read by agentcell itself: as root the mark is a trusted.* xattr, which the owner
    cannot read (review and apply run as them); rootless, the user's own user.* one. Walked by
    descriptor, never through a link (the change set is the owner's to rearrange)."""
    name = ("user." if meta.get("userxattr") else "trusted.") + "overlay.opaque"
    out: dict[str, list[str]] = {"opaque": []}
    try:
        top = os.open(_upper(meta), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return out
    stack: list[tuple[int, str]] = [(top, "")]
    while stack:
        fd, r = stack.pop()
        try:
            for e in os.scandir(fd):
                if not e.is_dir(follow_symlinks=False):
                    continue
                try:
                    sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError:
                    continue
                rel = f"{r}/{e.name}" if r else e.name
                try:
                    if os.getxattr(sub, name) == b"y":
                        out["opaque"].append(rel)
                except OSError:
                    pass
                stack.append((sub, rel))
        finally:
            os.close(fd)
    return out


def changes(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """What the agent changed, outside a git project's own ``.git``: one entry per path, {"path",
    "change" (added | modified | deleted | renamed | mode | type), "from" (renamed), "human_changed" (the
    project's path is not what the base had: changed, replaced, deleted or made since), "same" (the
    human's is what the agent's is), "hidden" (the view left it out: never diffed against the
    project's), "removes" (a directory the agent replaced: the files that go with it), "link" (a
    symlink's target), "mode"}."""
    upper, project, base_ns = _upper(meta), meta["project"], int(meta["base_ns"])
    hidden = set(meta.get("hidden") or [])
    git = meta.get("git") is not None
    base = _base_names(meta)
    opaque = set((meta.get("marks") or marks(meta))["opaque"])

    def theirs(rel: str, lst: os.stat_result | None) -> bool:
        ino = base.get(rel)
        if ino is None:  # not in the base (or hidden from the view): anything there now is the human's
            return lst is not None
        return lst is None or lst.st_ino != ino or lst.st_ctime_ns >= base_ns

    ordered = sorted(base)

    def below(rel: str) -> list[str]:
        """The files under ``rel`` in the base and in the project now."""
        i = bisect.bisect_left(ordered, rel + "/")
        j = bisect.bisect_left(ordered, rel + "0")  # ("0" follows "/")
        return sorted(set(ordered[i:j]) | set(_walk_files(project, rel)))

    out: list[dict[str, Any]] = []
    deleted: list[str] = []
    for rel, e in _walk(upper, skip=lambda rel, e: git and rel == ".git"):
        st = e.stat(follow_symlinks=False)
        low = os.path.join(project, rel)
        lst = _lstat(low)
        if _is_whiteout(st):
            if lst is not None and stat.S_ISDIR(lst.st_mode):  # a directory, as one: it goes whole
                files = below(rel)
                out.append({"path": rel, "change": "deleted", "dir": True, "removes": files, "same": False,
                            "seen": _seen(lst),
                            "hidden": _under_hidden(rel, hidden),
                            "human_changed": any(theirs(f, _lstat(os.path.join(project, f))) for f in files)})
            else:
                deleted.append(rel)
            continue
        if stat.S_ISDIR(st.st_mode):
            if lst is not None and stat.S_ISDIR(lst.st_mode):
                if rel in opaque:  # the agent removed the directory and made its own
                    deleted += sorted(set(below(rel)) - set(_walk_files(upper, rel)))
            elif lst is not None or rel in base:  # a file the agent replaced by a directory
                deleted.append(rel)
            continue
        c: dict[str, Any] = {"path": rel, "hidden": _under_hidden(rel, hidden), "mode": stat.S_IMODE(st.st_mode),
                             "seen": _seen(lst)}
        if stat.S_ISLNK(st.st_mode):
            c["link"] = os.readlink(e.path)
        if _kind(st) == "other":  # a fifo, a socket, a device: shown, never applied
            c.update(change="added" if lst is None else "type", human_changed=False, same=False, special=True)
        elif lst is not None and stat.S_ISDIR(lst.st_mode):  # a directory the agent replaced by a file
            files = below(rel)
            c.update(change="type", removes=files, same=False,
                     human_changed=any(theirs(f, _lstat(os.path.join(project, f))) for f in files))
        elif lst is None:
            c.update(change="modified" if rel in base else "added", human_changed=rel in base, same=False)
        else:
            same = _kind(lst) == _kind(st) and _digest(e.path, st) == _digest(low, lst)
            if same and stat.S_IMODE(st.st_mode) == stat.S_IMODE(lst.st_mode) and not theirs(rel, lst):
                continue  # copied up, not changed (opened for writing, touched)
            change = "type" if _kind(lst) != _kind(st) else "mode" if same else "modified"
            c.update(change=change if rel in base else "added", human_changed=theirs(rel, lst),
                     same=same and stat.S_IMODE(st.st_mode) == stat.S_IMODE(lst.st_mode))
        out.append(c)
    for rel in dict.fromkeys(deleted):
        lst = _lstat(os.path.join(project, rel))
        if lst is None and rel not in base:
            continue
        out.append({"path": rel, "change": "deleted", "human_changed": theirs(rel, lst), "same": lst is None,
                    "hidden": _under_hidden(rel, hidden), "seen": _seen(lst)})
    # A directory the agent replaced by a file takes its files with it: no deletion of them on their own.
    covered = [c["path"] for c in out if c.get("removes") and not c.get("dir")]
    out = [c for c in out if not (c["change"] == "deleted" and any(hostfs.within(c["path"], p) and c["path"] != p
                                                                     for p in covered))]
    _pair_renames(out, meta)
    return sorted(out, key=lambda c: c["path"])


def _seen(lst: os.stat_result | None) -> list[int] | None:
    """What the project's entry was when the change set was read: apply lands only on that very one."""
    return None if lst is None else [lst.st_ino, lst.st_ctime_ns]


def _under_hidden(rel: str, hidden: set[str]) -> bool:
    return any(hostfs.within(rel, h) for h in hidden)


def _pair_renames(out: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """A deletion and an addition of the same content are a rename (reported so; applied as both)."""
    upper = _upper(meta)
    gone: dict[str, dict[str, Any]] = {}
    for c in out:
        if c["change"] == "deleted":
            p = os.path.join(meta["project"], c["path"])
            st = _lstat(p)
            if st is not None and stat.S_ISREG(st.st_mode):
                gone.setdefault(_digest(p, st), c)
    if not gone:
        return
    for c in out:
        if c["change"] == "added":
            p = os.path.join(upper, c["path"])
            st = os.lstat(p)
            d = _digest(p, st) if stat.S_ISREG(st.st_mode) else None
            if d in gone:
                was = gone.pop(d)
                c["change"], c["from"], c["from_seen"] = "renamed", was["path"], was.get("seen")
                c["human_changed"] = c["human_changed"] or was["human_changed"]
                out.remove(was)
