"""Folder shares through POSIX ACLs, done by agentcell itself on file descriptors, never on path names.

A share adds one named-group entry for the agent's group ``agentcell-NAME`` (rwX or rX) to every
entry of the tree, and the same as a default entry on directories so files either side creates later
are covered too. Revoking removes every entry naming the agent's group *or user* (an agent can add
``u:<itself>`` entries to its own files) and nothing else: what the human or another agent changed
meanwhile stays. An access ACL left with no named entry becomes the plain mode again, keeping the
group permission the mask allowed (a chmod during the share is kept, never widened); a default ACL
left with none is removed, unless the directory had one before the share (recorded by device,
inode and path). No ACL is ever written back from a record: a recorded inode can be a new file.

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

import contextlib
import errno
import grp
import os
import resource
import stat
import struct
from collections.abc import Callable, Iterator

from .. import hostfs
from .commands import Commands

ACCESS, DEFAULT = "system.posix_acl_access", "system.posix_acl_default"
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
NAMED = (USER, GROUP)
UNDEFINED = 0xFFFFFFFF
MAX_DEPTH = 4096  # directory levels walked (each holds an fd while below it)

Entry = tuple[int, int, int]  # (tag, perm, id)


# ---- the ACL format ----------------------------------------------------------------------------

decode = hostfs.acl_decode


def encode(entries: list[Entry]) -> bytes:
    ordered = sorted(entries, key=lambda e: (e[0], e[2]))  # the kernel wants them by tag, then id
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in ordered)


def _proc(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


get = hostfs.acl_entries  # the entries of the file held by an fd, or None without such an ACL


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
    symlink followed (symlinks themselves are yielded, as O_PATH fds, only with ``links=True``).
    ``too_deep`` says whether levels were left out (past MAX_DEPTH, or past what the fd limit
    allows); any other error than an entry vanishing or being swapped raises."""

    SKIPPED = (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EXDEV)

    def __init__(self, root: str, *, links: bool = False) -> None:
        self.root, self.links, self.too_deep = root, links, False
        self.depth = MAX_DEPTH

    def __iter__(self) -> Iterator[Node]:
        from ..cell.paths import open_nofollow

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < min(hard, MAX_DEPTH + 256):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, MAX_DEPTH + 256), hard))
            soft = min(hard, MAX_DEPTH + 256)
        self.depth = min(MAX_DEPTH, soft - 64)  # each level holds an fd; leave some for the rest
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
        stack: list[tuple[int, str, Iterator[tuple[str, bool]]]] = []
        try:
            try:
                stack.append((top, "", _entries(top)))
            except OSError:
                os.close(top)
                raise
            yield Node(top, ".", top_st, None, None)
            while stack:
                dfd, rel, names = stack[-1]
                name, plain = next(names, ("", False))
                if not name:
                    stack.pop()
                    os.close(dfd)
                    continue
                path = f"{rel}{name}"
                if plain:  # a file when listed: opened as what it is now (below), never followed
                    is_dir = False
                else:
                    try:
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if st.st_dev != dev:
                        continue  # another file system mounted here: not part of the share
                    is_dir = stat.S_ISDIR(st.st_mode)
                    if stat.S_ISLNK(st.st_mode) and not self.links:
                        continue
                fd = -1
                for _ in range(3):  # a name swapped between the stat and the open is opened as what it is now
                    mode = os.O_RDONLY | os.O_DIRECTORY if is_dir else os.O_PATH
                    try:
                        fd = os.open(name, mode | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                    except OSError as e:
                        if e.errno == errno.ENOTDIR and is_dir:
                            is_dir = False
                            continue
                        if e.errno in self.SKIPPED:
                            break  # gone, or swapped for a symlink since the stat: skipped, never followed
                        raise
                    st = os.fstat(fd)
                    if stat.S_ISDIR(st.st_mode) == is_dir:
                        break
                    os.close(fd)
                    fd, is_dir = -1, stat.S_ISDIR(st.st_mode)
                if fd < 0:
                    continue
                if (stat.S_ISLNK(st.st_mode) and not self.links) or st.st_dev != dev:
                    os.close(fd)
                    continue
                if not stat.S_ISDIR(st.st_mode) or len(stack) >= self.depth:
                    self.too_deep |= stat.S_ISDIR(st.st_mode)
                    try:
                        yield Node(fd, path, st, dfd, name)
                    finally:
                        os.close(fd)
                    continue
                try:
                    below = _entries(fd)
                except OSError:
                    os.close(fd)
                    raise
                stack.append((fd, path + "/", below))  # owned by the stack from here on
                yield Node(fd, path, st, dfd, name)
        finally:
            for dfd, _rel, _names in stack:
                os.close(dfd)


def _entries(dfd: int) -> Iterator[tuple[str, bool]]:
    """A directory's names, sorted, each with whether its type in the directory says a plain file
    (neither a directory nor a symlink: opened without a stat first, which saves a call per file;
    what it is when opened is what counts). The rest, and a type the file system does not give, are
    looked at before they are opened, as a directory must be (another file system, an automount)."""
    with os.scandir(dfd) as it:
        found = [(e.name, _plain(e)) for e in it]
    return iter(sorted(found))


def _plain(e: os.DirEntry[str]) -> bool:
    try:  # (no call when the directory gives the type; an lstat of the name when it does not)
        return not e.is_dir(follow_symlinks=False) and not e.is_symlink()
    except OSError:
        return False


# ---- shares ------------------------------------------------------------------------------------

def prior_acl(root: str) -> list[str]:
    """``"DEV INO REL-HEX"`` for every directory that has a default ACL of its own before the share
    (REL is the path's bytes in hex: any name round-trips): revoke keeps theirs. One that names no
    one but other agents was made by their shares, not by the human, and does not count.
    :func:`grant` records the same as it goes (``prior=``), without a walk of its own."""
    out: list[str] = []
    for n in Walk(root):
        if stat.S_ISDIR(n.st.st_mode):
            _note_prior(n, get(n.fd, DEFAULT), out)
    return out


def _note_prior(n: Node, default: list[Entry] | None, out: list[str]) -> None:
    """:func:`prior_acl`'s record for one directory, if its default ACL is the human's own."""
    named = [(t, i) for t, _p, i in default or () if t in NAMED]
    if default is not None and not (named and all(t == GROUP and _group_name(i).startswith("agentcell-")
                                                  for t, i in named)):
        out.append(f"{n.st.st_dev} {n.st.st_ino} {os.fsencode(n.rel).hex()}")


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return ""


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


def _add(entries: list[Entry], ours: Entry) -> list[Entry]:
    """Add (or replace) the share's entry. A mask already there is the owner's ceiling for everyone
    named and stays as it is (setfacl -n): widening it would widen them too, and revoking could not
    tell what it was. Without one, the mask is the union, which widens no one."""
    rest = [e for e in entries if e[:1] + e[2:] != ours[:1] + ours[2:]]
    if any(e[0] == MASK for e in rest):
        return [*rest, ours]
    return _with_mask([*rest, ours])


@contextlib.contextmanager
def _one_change_at_a_time() -> Iterator[None]:
    """An ACL is changed read, modify, write (get it, add or drop our entry, put it back whole): two
    sessions on one project, one granting while the other revokes, would each write back the ACL they
    read, and one's entry would be lost (its agent finds the project unwritable mid-session). One change
    at a time on this host, under root's lock (flock: let go if its holder dies)."""
    with hostfs.host_lock("acl.lock"):
        yield


# (path below the root, its stat before, after): a file whose ACL was written. Only its ctime should
# differ: a snapshot store keyed by stat (snapshot.Store.carry) can then keep the content it knows.
Changed = Callable[[str, os.stat_result, os.stat_result], None]


def grant(cmds: Commands, group: str, gid: int, source: str, mode: str, *, prior: list[str] | None = None,
          changed: Changed | None = None) -> bool:
    """Give the group ``mode`` on every entry; False if levels past MAX_DEPTH were left out. ``prior``
    gets what :func:`prior_acl` would say, each directory's before its default ACL is written (one walk,
    not two; a grant cut short leaves the record of what it touched); ``changed`` hears of each file."""
    perm = "rwX" if mode == "rw" else "rX"
    cmds.show(["setfacl", "-R", "-P", "-n", "-m", f"g:{group}:{perm},d:g:{group}:{perm}", "--", source])
    if cmds.dry_run:
        return True
    with _one_change_at_a_time():
        walk = Walk(source)
        for n in walk:
            if not (stat.S_ISDIR(n.st.st_mode) or stat.S_ISREG(n.st.st_mode)):
                continue
            p = _perm(mode, n.st)
            put(n.fd, ACCESS, _add(get(n.fd) or base(n.st.st_mode), (GROUP, p, gid)))
            if stat.S_ISDIR(n.st.st_mode):
                default = get(n.fd, DEFAULT)
                if prior is not None:
                    _note_prior(n, default, prior)
                put(n.fd, DEFAULT, _add(default or base(n.st.st_mode), (GROUP, p, gid)))
            elif changed is not None:
                changed(n.rel, n.st, os.fstat(n.fd))
    return not walk.too_deep


def revoke(cmds: Commands, uid: int, gid: int, source: str, prior: list[str], *,
           changed: Changed | None = None, give_to: tuple[int, int] | None = None,
           others: list[str] | None = None) -> list[str]:
    """Remove every entry naming the agent (user ``uid`` or group ``gid``), and nothing else. Returns
    what could not be walked (empty when done). ``changed`` hears of each file whose ACL was written
    (not of one the agent owned). ``give_to`` (uid, gid): in the same walk, every entry owned by the
    agent is given to them as :func:`reassign` gives it, and what is still the agent's after that is
    returned too: for an account none of whose processes is left. A file made or moved behind the walk
    is missed by it: the caller checks with :func:`owned_by` after (``ephemeral.delete(given=True)``).
    ``others`` (with ``give_to``) gets a line for each entry a third user put in a directory of the
    agent's (:class:`_Theirs`): left theirs, for the human to look at."""
    if not os.path.lexists(source) or os.path.islink(source):
        return [] if give_to is None else [f"{source} is gone or a symlink now: what the agent made there is not "
                                           "given back"]
    cmds.show(["setfacl", "-R", "-P", "-x", f"g:{gid},d:g:{gid},u:{uid},d:u:{uid}", "--", source])
    if give_to is not None:
        cmds.show(["find", source, "-xdev", "(", "-uid", str(uid), "-o", "-gid", str(gid), ")", "-exec", "chown",
                   "--no-dereference", f"{give_to[0]}:{give_to[1]}", "--", "{}", "+"])
    if cmds.dry_run:
        return []
    had_default = set()
    for item in prior:
        dev, ino, rel = (item.split(" ") + ["", "", ""])[:3]
        if dev.isdigit() and ino.isdigit():
            had_default.add((int(dev), int(ino), os.fsdecode(bytes.fromhex(rel))))
    left: list[str] = []
    theirs = _Theirs(source, uid, gid, give_to[0] if give_to is not None and others is not None else None)
    with _one_change_at_a_time():
        walk = Walk(source, links=give_to is not None)
        for n in walk:
            agents = n.st.st_uid == uid or n.st.st_gid == gid
            theirs.see(n)
            if stat.S_ISDIR(n.st.st_mode) or stat.S_ISREG(n.st.st_mode):
                wrote = strip(n, lambda e: (e[0] == USER and e[2] == uid) or (e[0] == GROUP and e[2] == gid),
                              keep_default=(n.st.st_dev, n.st.st_ino, n.rel) in had_default)
                if wrote and changed is not None and stat.S_ISREG(n.st.st_mode) and not agents:
                    changed(n.rel, n.st, os.fstat(n.fd))
            if agents and give_to is not None:
                give(n, give_to[0], give_to[1], keep=lambda e: e[0] == USER and e[2] == give_to[0],
                     owner=n.st.st_uid == uid)
                st = os.fstat(n.fd)
                if st.st_uid == uid or st.st_gid == gid:
                    left.append(n.rel)
    if others is not None:
        others += theirs.said()
    out = _still_owned(left, uid, gid, source)
    return [*out, f"{source}: levels below {walk.depth} were not walked"] if walk.too_deep else out


class _Theirs:
    """What a third user (not the agent, not ``human``, not root) put in a directory of the agent's while
    it was open to others, as a walk that gives the agent's files back sees it. Reported, not taken: such
    an entry may be a hard link to a file of theirs elsewhere, and it is theirs to remove. With ``human``
    None (nothing given back) nothing is looked for."""

    def __init__(self, place: str, uid: int, gid: int, human: int | None) -> None:
        self.place, self.uid, self.gid, self.human = place, uid, gid, human
        self.dirs: set[str] = set()
        self.found: list[tuple[str, int]] = []

    def see(self, n: Node) -> None:
        if self.human is None:
            return
        if (n.st.st_uid == self.uid or n.st.st_gid == self.gid) and stat.S_ISDIR(n.st.st_mode):
            self.dirs.add(n.rel)
        elif n.st.st_uid not in (self.uid, self.human, 0) and n.rel != "." and \
                (os.path.dirname(n.rel) or ".") in self.dirs:
            self.found.append((n.rel, n.st.st_uid))

    def said(self) -> list[str]:
        import pwd

        out = []
        for rel, uid in self.found[:3]:
            try:
                who = f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
            except KeyError:
                who = f"uid {uid}"
            out.append(f"{os.path.join(self.place, rel)} belongs to {who}, who put it in a directory the agent had "
                       "opened to others: it is left theirs (they can go on changing it); look at it before you "
                       "use the project")
        if len(self.found) > 3:
            out.append(f"... and {len(self.found) - 3} more of other users' in the agent's directories in {self.place}")
        return out


def strip(n: Node, drop: Callable[[Entry], bool], *, keep_default: bool = False) -> bool:
    """Remove the entries ``drop`` selects from the node's ACLs. An access ACL left without named
    entries becomes the plain mode, its group permission what the mask allowed (a chmod made while
    shared stays); a default ACL left without them is removed unless ``keep_default``. Whether it
    wrote anything."""
    access = get(n.fd)
    wrote = False
    if access is not None and any(drop(e) for e in access):
        wrote = True
        rest = [e for e in access if not drop(e)]
        if not any(e[0] in NAMED for e in rest):
            mask = next((p for t, p, _ in rest if t == MASK), 7)
            rest = [(t, p & mask if t == GROUP_OBJ else p, i) for t, p, i in rest if t != MASK]
        put(n.fd, ACCESS, rest)
    default = get(n.fd, DEFAULT) if stat.S_ISDIR(n.st.st_mode) else None
    if default is not None and any(drop(e) for e in default):
        rest = [e for e in default if not drop(e)]
        if not any(e[0] in NAMED for e in rest):
            rest = [e for e in rest if e[0] != MASK] if keep_default else []
        put(n.fd, DEFAULT, rest or None)
        wrote = True
    return wrote


def reassign(cmds: Commands, uid: int, gid: int, to_uid: int, to_gid: int, place: str, *,
             others: list[str] | None = None) -> list[str]:
    """Give every entry owned by ``uid`` or group ``gid`` to ``to_uid:to_gid``, as the human would
    want to receive it: no setuid/setgid bit, not writable by others, no ACL entry naming anyone but
    the human (the agent chose those). Returns what is left (empty when all moved); ``others`` as
    :func:`revoke`'s."""
    cmds.show(["find", place, "-xdev", "(", "-uid", str(uid), "-o", "-gid", str(gid), ")", "-exec", "chown",
               "--no-dereference", f"{to_uid}:{to_gid}", "--", "{}", "+"])
    if cmds.dry_run:
        return []
    theirs = _Theirs(place, uid, gid, to_uid if others is not None else None)
    for n in Walk(place, links=True):
        theirs.see(n)
        if n.st.st_uid == uid or n.st.st_gid == gid:
            give(n, to_uid, to_gid, keep=lambda e: e[0] == USER and e[2] == to_uid, owner=n.st.st_uid == uid)
    if others is not None:
        others += theirs.said()
    return owned_by(uid, gid, place)


def give(n: Node, to_uid: int, to_gid: int, keep: Callable[[Entry], bool] = lambda e: False, *,
         owner: bool = True) -> None:
    """Make one walked entry ``to_uid:to_gid``'s as its receiver wants it: chowned (the file opened, not a
    name that could be swapped), no setuid/setgid bit, not writable by others, no named ACL entry but
    those ``keep`` selects (the rest were someone else's choice). ``owner`` False: the entry is a third
    user's that only has the agent's group (made in a setgid directory of the agent's): it stays theirs,
    its group becomes ``to_gid`` and it loses its setuid/setgid bits, nothing else (it may be a hard link
    to a file of theirs elsewhere)."""
    from ..cell import syscalls

    if not owner:
        syscalls.fchown_fd(n.fd, -1, to_gid)
        if not stat.S_ISLNK(n.st.st_mode) and n.st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(_proc(n.fd), stat.S_IMODE(n.st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
        return
    syscalls.fchown_fd(n.fd, to_uid, to_gid)
    if stat.S_ISLNK(n.st.st_mode):
        return
    if n.st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_IWOTH):
        os.chmod(_proc(n.fd), stat.S_IMODE(n.st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID | stat.S_IWOTH))
    if stat.S_ISDIR(n.st.st_mode) or stat.S_ISREG(n.st.st_mode):
        strip(n, lambda e: e[0] in NAMED and not keep(e))
        default = get(n.fd, DEFAULT) if stat.S_ISDIR(n.st.st_mode) else None
        if default is not None and any(t == OTHER and p & 2 for t, p, _ in default):
            put(n.fd, DEFAULT, [(t, p & ~2 if t == OTHER else p, i) for t, p, i in default])


def owned_by(uid: int, gid: int, place: str) -> list[str]:
    """Entries below ``place`` still owned by ``uid`` or ``gid`` (a description per entry, first few)."""
    if not os.path.lexists(place) or os.path.islink(place):
        return []
    walk = Walk(place, links=True)
    out = _still_owned([n.rel for n in walk if n.st.st_uid == uid or n.st.st_gid == gid], uid, gid, place)
    if walk.too_deep:
        out.append(f"{place}: levels below {MAX_DEPTH} were not walked")
    return out


def _still_owned(left: list[str], uid: int, gid: int, place: str) -> list[str]:
    out = [f"{os.path.join(place, r)} is still owned by {uid}:{gid}" for r in left[:3]]
    if len(left) > 3:
        out.append(f"... and {len(left) - 3} more in {place}")
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
