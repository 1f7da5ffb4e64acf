"""Folder shares through POSIX ACLs, done by agentcell itself on file descriptors, never on path names.

A share adds one named-group entry for the agent's group ``agentcell-NAME`` (rwX or rX) to every
entry of the tree, and the same as a default entry on directories so files either side creates later
are covered too. Revoking removes every entry naming the agent's group *or user* (an agent can add
``u:<itself>`` entries to its own files), strips what is left to the plain mode on entries that had
no ACL before the share, and gives entries that had one exactly theirs back.

Why not ``setfacl -R`` and ``find -exec chown`` (what the printed, equivalent commands say): they
walk by path name. An agent — or a second agent sharing the folder, or any user who can write in it
— can swap a directory for a symlink between the moment a path is read and the moment it is used,
and root then changes the ACL, mode or owner of a file anywhere (found by a red-team pass). Here the
walk holds a directory fd at each level, opens every child relative to it with ``O_NOFOLLOW``, acts
on the file it opened (``/proc/self/fd/N`` for the ACL, ``fchownat(AT_SYMLINK_NOFOLLOW)`` by name in
the parent for the owner), does not cross into other file systems, and has no recursion, so a deep
tree cannot crash it (past :data:`MAX_DEPTH` levels it stops and says so).

ACLs are read and written as their extended attributes (``system.posix_acl_access`` and
``system.posix_acl_default``: a version word, then (tag, perm, id) entries sorted by tag and id).
"""
from __future__ import annotations

import errno
import os
import resource
import stat
import struct
from collections.abc import Iterator

from .commands import Commands

ACCESS, DEFAULT = "system.posix_acl_access", "system.posix_acl_default"
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
NAMED = (USER, GROUP)
UNDEFINED = 0xFFFFFFFF
MAX_DEPTH = 4096  # directory levels walked (each holds an fd while below it)

Entry = tuple[int, int, int]  # (tag, perm, id)


# ---- the ACL format ----------------------------------------------------------------------------

def decode(raw: bytes) -> list[Entry] | None:
    if len(raw) < 4 or (len(raw) - 4) % 8:
        return None
    return [struct.unpack_from("<HHI", raw, off) for off in range(4, len(raw), 8)]


def encode(entries: list[Entry]) -> bytes:
    ordered = sorted(entries, key=lambda e: (e[0], e[2]))  # the kernel wants them by tag, then id
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in ordered)


def _proc(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def get(fd: int, which: str = ACCESS) -> list[Entry] | None:
    """The entries of the file held by ``fd`` (an O_PATH fd is enough), or None without such an ACL."""
    try:
        return decode(os.getxattr(_proc(fd), which))
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise


def put(fd: int, which: str, entries: list[Entry] | None) -> None:
    """Set (or with None, remove) an ACL. An access ACL equivalent to the mode is stored as the mode."""
    if entries is None:
        try:
            os.removexattr(_proc(fd), which)
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise
        return
    os.setxattr(_proc(fd), which, encode(entries))


def base(mode: int) -> list[Entry]:
    return [(USER_OBJ, (mode >> 6) & 7, UNDEFINED), (GROUP_OBJ, (mode >> 3) & 7, UNDEFINED),
            (OTHER, mode & 7, UNDEFINED)]


def _with_mask(entries: list[Entry]) -> list[Entry]:
    """Recompute the mask as setfacl does (the union of the group class); none when nothing is named."""
    rest = [e for e in entries if e[0] != MASK]
    if not any(e[0] in NAMED for e in rest):
        return rest
    union = 0
    for tag, perm, _ in rest:
        if tag in (USER, GROUP_OBJ, GROUP):
            union |= perm
    return [*rest, (MASK, union, UNDEFINED)]


def _minimal(entries: list[Entry]) -> list[Entry]:
    """The access ACL without named entries or mask: the plain mode (the kernel then drops the xattr)."""
    return [e for e in entries if e[0] in (USER_OBJ, GROUP_OBJ, OTHER)]


# ---- the walk ----------------------------------------------------------------------------------

class Node:
    """One entry of the tree, held open: ``fd`` is an O_PATH fd (a directory's is readable), ``parent``
    the fd of its directory and ``name`` its name there (None for the root)."""

    __slots__ = ("fd", "rel", "st", "parent", "name")

    def __init__(self, fd: int, rel: str, st: os.stat_result, parent: int | None, name: str | None) -> None:
        self.fd, self.rel, self.st, self.parent, self.name = fd, rel, st, parent, name


class Walk:
    """``for node in Walk(root)``: the root and everything below it on the same file system, no
    symlink followed (symlinks themselves are yielded only with ``links=True``, with fd -1).
    ``too_deep`` says whether levels past MAX_DEPTH were skipped."""

    def __init__(self, root: str, *, links: bool = False) -> None:
        self.root, self.links, self.too_deep = root, links, False

    def __iter__(self) -> Iterator[Node]:
        from ..cell.paths import open_nofollow

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < min(hard, MAX_DEPTH + 256):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, MAX_DEPTH + 256), hard))
        top = open_nofollow(self.root)  # LaunchError if a component is a symlink
        try:
            st = os.fstat(top)
            if not stat.S_ISDIR(st.st_mode):
                yield Node(top, ".", st, None, None)
                return
            dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=top)
        finally:
            os.close(top)
        yield from self._below(dfd, st)

    def _below(self, top: int, top_st: os.stat_result) -> Iterator[Node]:
        """Depth first with a stack of open directories (no recursion); every fd it opens is closed
        when the walk ends, however it ends."""
        dev = top_st.st_dev
        stack: list[tuple[int, str, Iterator[str]]] = []
        try:
            try:
                stack.append((top, "", iter(sorted(os.listdir(top)))))
            except OSError:
                os.close(top)
                raise
            yield Node(top, ".", top_st, None, None)
            while stack:
                dfd, rel, names = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    os.close(dfd)
                    continue
                path = f"{rel}{name}"
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev != dev:
                    continue  # another file system mounted here: not part of the share
                if stat.S_ISLNK(st.st_mode):
                    if self.links:
                        yield Node(-1, path, st, dfd, name)
                    continue
                is_dir = stat.S_ISDIR(st.st_mode)
                try:
                    fd = os.open(name, (os.O_RDONLY | os.O_DIRECTORY if is_dir else os.O_PATH) | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, dir_fd=dfd)
                except OSError:
                    continue  # gone, or swapped for a symlink since the stat: skipped, never followed
                st = os.fstat(fd)
                if not stat.S_ISDIR(st.st_mode) or len(stack) >= MAX_DEPTH:
                    self.too_deep |= stat.S_ISDIR(st.st_mode)
                    try:
                        yield Node(fd, path, st, dfd, name)
                    finally:
                        os.close(fd)
                    continue
                try:
                    below = iter(sorted(os.listdir(fd)))
                except OSError:
                    below = iter(())
                stack.append((fd, path + "/", below))  # owned by the stack from here on
                yield Node(fd, path, st, dfd, name)
        finally:
            for dfd, _rel, _names in stack:
                os.close(dfd)


# ---- shares ------------------------------------------------------------------------------------

def prior_acl(root: str) -> list[str]:
    """``"DEV INO REL-HEX ACCESS-HEX DEFAULT-HEX"`` for every entry with an ACL of its own: what revoke
    gives back, to that very file only (REL is the path's bytes in hex: any name round-trips)."""
    out = []
    for n in Walk(root):
        a, d = _raw(n.fd, ACCESS), _raw(n.fd, DEFAULT)
        if a or d:
            out.append(f"{n.st.st_dev} {n.st.st_ino} {os.fsencode(n.rel).hex()} {a.hex()} {d.hex()}")
    return out


def _raw(fd: int, which: str) -> bytes:
    try:
        return os.getxattr(_proc(fd), which)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return b""
        raise


def _perm(mode: str, st: os.stat_result) -> int:
    x = 1 if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111 else 0  # setfacl's X
    return (6 if mode == "rw" else 4) | x


def grant(cmds: Commands, group: str, gid: int, source: str, mode: str) -> bool:
    """Give the group ``mode`` on every entry; False if levels past MAX_DEPTH were left out."""
    perm = "rwX" if mode == "rw" else "rX"
    cmds.show(["setfacl", "-R", "-P", "-m", f"g:{group}:{perm},d:g:{group}:{perm}", "--", source])
    if cmds.dry_run:
        return True
    walk = Walk(source)
    for n in walk:
        if not (stat.S_ISDIR(n.st.st_mode) or stat.S_ISREG(n.st.st_mode)):
            continue
        p = _perm(mode, n.st)
        access = [e for e in (get(n.fd) or base(n.st.st_mode)) if not (e[0] == GROUP and e[2] == gid)]
        put(n.fd, ACCESS, _with_mask([*access, (GROUP, p, gid)]))
        if stat.S_ISDIR(n.st.st_mode):
            default = [e for e in (get(n.fd, DEFAULT) or base(n.st.st_mode)) if not (e[0] == GROUP and e[2] == gid)]
            put(n.fd, DEFAULT, _with_mask([*default, (GROUP, p, gid)]))
    return not walk.too_deep


def revoke(cmds: Commands, uid: int, gid: int, source: str, prior: list[str]) -> list[str]:
    """Remove every entry naming the agent (user ``uid`` or group ``gid``); entries that had an ACL
    before the share get it back (without the agent's entries), the others keep only what names
    someone else. Returns what could not be walked (empty when done)."""
    if not os.path.lexists(source) or os.path.islink(source):
        return []
    cmds.show(["setfacl", "-R", "-P", "-x", f"g:{gid},d:g:{gid},u:{uid},d:u:{uid}", "--", source])
    if cmds.dry_run:
        return []
    kept: dict[tuple[int, int, str], tuple[bytes, bytes]] = {}
    for item in prior:
        dev, ino, rel, a, d = (item.split(" ") + ["", "", "", "", ""])[:5]
        if dev.isdigit() and ino.isdigit():
            kept[(int(dev), int(ino), os.fsdecode(bytes.fromhex(rel)))] = (bytes.fromhex(a), bytes.fromhex(d))

    def agents(e: Entry) -> bool:
        return (e[0] == USER and e[2] == uid) or (e[0] == GROUP and e[2] == gid)

    walk = Walk(source)
    for n in walk:
        if not (stat.S_ISDIR(n.st.st_mode) or stat.S_ISREG(n.st.st_mode)):
            continue
        before = kept.get((n.st.st_dev, n.st.st_ino, n.rel))
        for which in (ACCESS, DEFAULT):
            now = get(n.fd, which)
            if before is not None:
                old = decode(before[0 if which == ACCESS else 1]) if before[0 if which == ACCESS else 1] else None
                want = None if old is None else [e for e in old if not agents(e)]
                if want is not None and any(agents(e) for e in old or ()):
                    want = _with_mask(want)
            elif now is None:
                continue
            else:
                want = [e for e in now if not agents(e)]
                want = _with_mask(want) if any(e[0] in NAMED for e in want) else None
            if which == ACCESS and want is None:
                want = _minimal(now or base(n.st.st_mode))
            if want != now:
                put(n.fd, which, want)
    return [f"{source}: levels below {MAX_DEPTH} were not walked"] if walk.too_deep else []


def reassign(cmds: Commands, uid: int, gid: int, to_uid: int, to_gid: int, place: str) -> list[str]:
    """Give every entry owned by ``uid`` or group ``gid`` to ``to_uid:to_gid``; what is left (empty when
    all moved)."""
    cmds.show(["find", place, "-xdev", "(", "-uid", str(uid), "-o", "-gid", str(gid), ")", "-exec", "chown",
               "--no-dereference", f"{to_uid}:{to_gid}", "--", "{}", "+"])
    if cmds.dry_run:
        return []
    walk = Walk(place, links=True)
    for n in walk:
        if n.st.st_uid != uid and n.st.st_gid != gid:
            continue
        if n.parent is None:
            os.chown(_proc(n.fd), to_uid, to_gid)
        else:
            os.chown(n.name or "", to_uid, to_gid, dir_fd=n.parent, follow_symlinks=False)
    return owned_by(uid, gid, place)


def owned_by(uid: int, gid: int, place: str) -> list[str]:
    """Entries below ``place`` still owned by ``uid`` or ``gid`` (a description per entry, first few)."""
    if not os.path.lexists(place) or os.path.islink(place):
        return []
    walk = Walk(place, links=True)
    left = [n.rel for n in walk if n.st.st_uid == uid or n.st.st_gid == gid]
    out = [f"{os.path.join(place, r)} is still owned by {uid}:{gid}" for r in left[:3]]
    if len(left) > 3:
        out.append(f"... and {len(left) - 3} more in {place}")
    if walk.too_deep:
        out.append(f"{place}: levels below {MAX_DEPTH} were not walked")
    return out


def residue(uid: int, gid: int, source: str) -> list[str]:
    """Entries below ``source`` whose ACL still names the agent's user or group."""
    if not os.path.lexists(source) or os.path.islink(source):
        return []
    out = []
    for n in Walk(source):
        for which in (ACCESS, DEFAULT):
            if any((t == GROUP and i == gid) or (t == USER and i == uid) for t, _p, i in get(n.fd, which) or ()):
                out.append(os.path.join(source, n.rel))
                break
    return out


def named_gids(path: str) -> set[int]:
    """Groups named in the access ACL of ``path`` (for the health check)."""
    from ..cell.paths import open_nofollow

    fd = open_nofollow(path)
    try:
        return {i for t, _p, i in get(fd) or () if t == GROUP}
    finally:
        os.close(fd)


def default_entries(path: str) -> list[Entry]:
    from ..cell.paths import open_nofollow

    fd = open_nofollow(path)
    try:
        return get(fd, DEFAULT) or []
    finally:
        os.close(fd)
