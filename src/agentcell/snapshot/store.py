"""Snapshots: a content-addressed store of our own (why ours: see bench/snapshot.py and the issue note).

Layout of a store (``$BACKUP_DIR``, ``--store DIR``, default ``<state dir>/snapshots``; 0700, the
supervisor's, never inside a path it snapshots)::

    objects/ab/abcdef…   a file's content, named by its SHA-256 (stored once, however many files
                         and snapshots have it)
    snapshots/<id>.json  one manifest per snapshot: every entry of every root, with type, mode, owner,
                         mtime, size, and the content's hash (files) or target (symlinks)
    cache/<root>.json    the stat of each file at the last snapshot of that root (size, mtime, ctime,
                         inode) and its hash: a file whose stat is unchanged is not read again

Taking a snapshot of an unchanged tree therefore reads no file and writes one manifest. ctime is
part of the key because nobody but root can set it back: content changed with a faked mtime is
still read again.

Restores are exact and in place by default: content, modes, owners, mtimes, symlinks (recreated,
never followed), empty directories, and whatever was added since the snapshot is removed. A restore
runs as root on a tree the agent wrote, so it walks on directory fds opened with O_NOFOLLOW (a
directory the agent swapped for a symlink is replaced, not followed); a file is written to a new
name beside its destination and renamed over it.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import hostfs
from ..errors import AgentcellError

CHUNK = 1 << 20
Progress = Callable[[int, int], None]  # (done, total) bytes or entries


class SnapshotError(AgentcellError):
    pass


def default_store() -> str:
    from ..hostfs import state_dir

    return os.environ.get("BACKUP_DIR") or os.path.join(state_dir(), "snapshots")


def _hexpath(rel: str) -> str:
    return os.fsencode(rel).hex()


def _unhex(h: str) -> str:
    return os.fsdecode(bytes.fromhex(h))


STORE_DIRS = ("objects", "snapshots", "cache")  # what a store holds, and all it holds


class Store:
    def __init__(self, path: str | None = None) -> None:
        # normpath: '//' stays '//' under abspath (POSIX), and its dirname is itself
        self.path = "/" + os.path.abspath(path or default_store()).lstrip("/")

    # ---- the store itself ------------------------------------------------------------------------

    def _ready(self, roots: tuple[str, ...] = ()) -> None:
        for root in roots:
            if self.path == root or self.path.startswith(root.rstrip("/") + "/"):
                raise SnapshotError("--store", f"{self.path} is inside {root}, which it would snapshot (and which "
                                    "the agent may write)", "put the store outside the snapshotted paths")
        # Nobody else (an agent) may rename the store or a directory above it away and put their own
        # there: checked before anything is made.
        d = os.path.dirname(self.path)
        while True:
            try:
                pst = os.lstat(d)
            except FileNotFoundError:
                if d == os.path.dirname(d):
                    break
                d = os.path.dirname(d)
                continue
            if not hostfs.changeable_only_by(pst, {0, os.geteuid()}, sticky_ok=True):
                raise SnapshotError("--store", f"{d}, above the store, can be changed by others (an agent could "
                                    "swap the store)", "put the store where only you and root can write")
            if d == os.path.dirname(d):  # the top
                break
            d = os.path.dirname(d)
        # A store is a directory of its own: new, empty, or a store already. Never '/' or /etc, say,
        # where its directories would be made among the system's ('--store //' did).
        try:
            if not stat.S_ISDIR(os.lstat(self.path).st_mode):  # a link too: nothing is made through it
                raise SnapshotError("--store", f"{self.path} is not a directory (a link is not followed)",
                                    "give a new or empty directory, or an existing store")
            others = sorted(set(os.listdir(self.path)) - {*STORE_DIRS, "lost+found"})
        except FileNotFoundError:
            others = []
        except OSError as e:
            raise SnapshotError("--store", f"cannot read {self.path}: {e.strerror}",
                                "give a new or empty directory, or an existing store") from None
        if others:
            raise SnapshotError("--store", f"{self.path} holds other things ({', '.join(others[:3])}"
                                f"{', …' if len(others) > 3 else ''}), so it is not a snapshot store",
                                "give a new or empty directory, or an existing store")
        try:
            for sub in ("", *STORE_DIRS):
                os.makedirs(os.path.join(self.path, sub), mode=0o700, exist_ok=True)
        except OSError as e:
            raise SnapshotError("--store", f"cannot create {self.path}: {e.strerror}",
                                "give a directory you can write (--store or BACKUP_DIR)") from None
        if not hostfs.only_ours_at(self.path, {os.geteuid()}, directory=True):
            raise SnapshotError("--store", f"{self.path} must be a directory of yours that nobody else can write "
                                "(by its mode or an ACL)",
                                f"chmod 700 {self.path}, or another --store")
        if not os.access(self.path, os.W_OK):
            raise SnapshotError("--store", f"{self.path} is not writable", "another --store, or fix its permissions")

    def _object(self, digest: str) -> str:
        return os.path.join(self.path, "objects", digest[:2], digest)

    def _manifest_path(self, sid: str) -> str:
        if not sid or "/" in sid or sid.startswith("."):
            raise SnapshotError("ID", f"'{sid}' is not a snapshot id", "see 'agentcell snapshot list'")
        return os.path.join(self.path, "snapshots", f"{sid}.json")

    def manifest(self, sid: str) -> dict[str, Any]:
        path = self._manifest_path(sid)
        try:
            with open(path, "rb") as f:
                raw = f.read()
            with open(path[:-5] + ".sha256") as f:
                if f.read().strip() != hashlib.sha256(raw).hexdigest():
                    raise ValueError("its hash does not match")
            data: dict[str, Any] = json.loads(raw)
        except FileNotFoundError:
            raise SnapshotError("ID", f"no snapshot {sid} in {self.path}", "see 'agentcell snapshot list'") from None
        except ValueError:
            raise SnapshotError("ID", f"the manifest of {sid} is damaged",
                                "'agentcell snapshot verify' says more") from None
        return data

    def snapshots(self) -> list[dict[str, Any]]:
        out = []
        try:
            names = sorted(os.listdir(os.path.join(self.path, "snapshots")))
        except FileNotFoundError:
            return []
        for name in names:
            if name.endswith(".json"):
                try:
                    m = self.manifest(name[:-5])
                except SnapshotError:
                    continue
                out.append({"id": m["id"], "created": m["created"], "roots": list(m["roots"]),
                            "entries": sum(len(r["entries"]) for r in m["roots"].values()),
                            "bytes": m.get("bytes", 0)})
        return out

    # ---- take ------------------------------------------------------------------------------------

    def take(self, paths: list[str], progress: Progress | None = None) -> str:
        """A snapshot of ``paths``; its id. New content is kept in a staging directory of its own until
        the snapshot is whole, then moved into the store: one that fails (no room, a file that changes,
        no inodes) leaves nothing behind. New content may fill at most 90 % of the free space, all of
        it together."""
        roots = tuple(_resolve_root(p) for p in paths)
        self._ready(roots)
        sid = time.strftime("%Y%m%dT%H%M%S") + "-" + os.urandom(3).hex()
        staging = os.path.join(self.path, "objects", f".take-{sid}")
        try:
            os.mkdir(staging, 0o700)
            self._staged: dict[str, str] = {}
            return self._take(sid, roots, staging, progress)
        except OSError as e:  # no space, no inodes, a store that went away
            raise SnapshotError("--store", f"cannot store the snapshot in {self.path}: {e.strerror}",
                                "make room there (space and inodes), or give another --store") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _take(self, sid: str, roots: tuple[str, ...], staging: str, progress: Progress | None) -> str:
        manifest: dict[str, Any] = {"id": sid, "created": time.time(), "roots": {}, "format": 1}
        total = 0
        budget = _free_bytes(self.path) * 9 // 10  # new content may fill at most 90 % of the free space
        for root in roots:
            _syncfs(root)  # clean pages: a later write through a shared mapping must update mtime/ctime
            cache_path = os.path.join(self.path, "cache", hashlib.sha256(os.fsencode(root)).hexdigest() + ".json")
            cache = _load_json(cache_path)
            entries, new_cache = [], {}
            from ..accounts.acl import ACCESS, DEFAULT, Walk, _raw

            walk = Walk(root, links=True)
            for n in walk:
                st = n.st
                if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    continue  # sockets, FIFOs, devices: not project content, not restorable as such
                e: dict[str, Any] = {"p": _hexpath(n.rel), "mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid,
                                     "mtime": st.st_mtime_ns}
                if not stat.S_ISLNK(st.st_mode):
                    for key_name, which in (("acl", ACCESS), ("dacl", DEFAULT)):
                        raw = _raw(n.fd, which)
                        if raw:
                            e[key_name] = raw.hex()
                if stat.S_ISREG(st.st_mode):
                    key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
                    hit = cache.get(e["p"])
                    if hit is not None and hit[:4] == key and os.path.exists(self._object(hit[4])):
                        digest = hit[4]
                    else:
                        if st.st_size > budget:
                            raise SnapshotError("PATH", f"{os.path.join(root, n.rel)} ({st.st_size} bytes) does not "
                                                "fit in what is left of 90 % of the store's free space",
                                                "free space, or another --store")
                        digest, stored = self._put(n.fd, st, os.path.join(root, n.rel), staging)
                        budget -= stored
                    e.update(size=st.st_size, sha=digest, stat=key)
                    new_cache[e["p"]] = [*key, digest]
                    total += st.st_size
                    if progress:
                        progress(total, 0)
                elif stat.S_ISLNK(st.st_mode):
                    e["target"] = os.fsencode(os.readlink(n.name or "", dir_fd=n.parent)).hex() \
                        if n.parent is not None else ""
                entries.append(e)
            if walk.too_deep:
                raise SnapshotError("PATH", f"{root} is deeper than the {walk.depth} levels a snapshot walks",
                                    "remove the deep tree (an agent may have made it), or raise the fd limit")
            manifest["roots"][root] = {"entries": entries}
            _write_json(cache_path, new_cache)
        manifest["bytes"] = total
        for digest, tmp in self._staged.items():  # whole: its new content joins the store
            dest = self._object(digest)
            if os.path.exists(dest):
                continue  # another snapshot stored the same content meanwhile
            os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
            os.rename(tmp, dest)
        _syncfs(self.path)  # every object on disk before the manifest that names them (one sync, not 20,000)
        raw = json.dumps(manifest, separators=(",", ":")).encode()
        path = self._manifest_path(sid)
        hostfs.replace_file(path[:-5] + ".sha256", hashlib.sha256(raw).hexdigest().encode())  # the manifest's check
        hostfs.replace_file(path, raw)  # last: a snapshot exists once its manifest does
        return sid

    def _put(self, opath: int, st: os.stat_result, shown: str, staging: str) -> tuple[str, int]:
        """Read the very file the walk opened (never a name again): hash it and, if the store (or this
        snapshot's staging) lacks that content, keep a copy in the staging; (hash, bytes stored). A
        file that changes while read is refused: its owner and mode would not go with its content."""
        fd = os.open(f"/proc/self/fd/{opath}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if _key(os.fstat(fd)) != _key(st):
                raise SnapshotError("PATH", f"{shown} changed while it was snapshotted",
                                    "no agent process may run during a snapshot; try again when none does")
            tmp = os.path.join(staging, f".tmp-{os.urandom(6).hex()}")
            h = hashlib.sha256()
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                while chunk := os.read(fd, CHUNK):
                    h.update(chunk)
                    _write_all(out, chunk)
            except BaseException:
                os.close(out)
                os.unlink(tmp)
                raise
            os.close(out)
            if _key(os.fstat(fd)) != _key(st):
                os.unlink(tmp)
                raise SnapshotError("PATH", f"{shown} changed while it was snapshotted",
                                    "no agent process may run during a snapshot; try again when none does")
        finally:
            os.close(fd)
        digest = h.hexdigest()
        if os.path.exists(self._object(digest)) or digest in self._staged:
            os.unlink(tmp)
            return digest, 0
        staged = os.path.join(staging, digest)
        os.rename(tmp, staged)
        self._staged[digest] = staged
        return digest, st.st_size

    # ---- verify ----------------------------------------------------------------------------------

    def verify(self, sid: str, progress: Progress | None = None) -> list[str]:
        """Every object the snapshot names is there and still has its hash; problems (empty: sound)."""
        m = self.manifest(sid)
        problems, done = [], 0
        total = sum(e.get("size", 0) for r in m["roots"].values() for e in r["entries"])
        checked: set[str] = set()
        for root, r in m["roots"].items():
            for e in r["entries"]:
                digest = e.get("sha")
                if digest is None or digest in checked:
                    continue
                checked.add(digest)
                try:
                    h = hashlib.sha256()
                    with open(self._object(digest), "rb") as f:
                        while chunk := f.read(CHUNK):
                            h.update(chunk)
                    if h.hexdigest() != digest:
                        problems.append(f"{os.path.join(root, _unhex(e['p']))}: its stored content is damaged")
                except FileNotFoundError:
                    problems.append(f"{os.path.join(root, _unhex(e['p']))}: its stored content is missing")
                done += e.get("size", 0)
                if progress:
                    progress(done, total)
        return problems

    # ---- restore ---------------------------------------------------------------------------------

    def restore(self, sid: str, paths: list[str] | None = None, to: str | None = None,
                progress: Progress | None = None) -> int:
        """Make each root (or the given paths below them) exactly as it was; returns entries written.
        With ``to``, into that directory instead (``to``/<root without its leading />)."""
        m = self.manifest(sid)
        problems = self.verify(sid)
        if problems:
            raise SnapshotError("ID", f"snapshot {sid} is damaged ({problems[0]}; {len(problems)} in all)",
                                "it cannot be restored exactly; 'agentcell snapshot verify' lists the damage")
        written = 0
        wanted = [os.path.abspath(p) for p in paths or []]
        for root, r in m["roots"].items():
            entries = {_unhex(e["p"]): e for e in r["entries"]}
            if wanted:
                subset = [w for w in wanted if w == root or w.startswith(root.rstrip("/") + "/")]
                if not subset:
                    continue
            else:
                subset = [root]
            dest_root = os.path.join(to, root.lstrip("/")) if to else root
            for w in subset:
                rel = os.path.relpath(w, root)
                written += _Restorer(self, dest_root, entries, progress).run(rel)
            _syncfs(dest_root)
        return written

    # ---- diff ------------------------------------------------------------------------------------

    def diff(self, sid: str) -> dict[str, list[str]]:
        """What changed since the snapshot: added, modified, deleted (paths); text diffs separately."""
        m = self.manifest(sid)
        out: dict[str, list[str]] = {"added": [], "modified": [], "deleted": []}
        for root, r in m["roots"].items():
            then = {_unhex(e["p"]): e for e in r["entries"]}
            now = {rel: (st, link) for rel, st, link in _walk(root)} if os.path.lexists(root) else {}
            for rel in sorted(set(then) | set(now)):
                full = os.path.normpath(os.path.join(root, rel))
                if rel not in now:
                    out["deleted"].append(full)
                elif rel not in then:
                    out["added"].append(full)
                elif _changed(then[rel], *now[rel], root, rel):
                    out["modified"].append(full)
        return out

    def text_diff(self, sid: str, path: str, limit: int = 1 << 20) -> str:
        """A unified diff of a text file between the snapshot and now ('' if binary or unchanged)."""
        import difflib

        m = self.manifest(sid)
        path = os.path.abspath(path)
        for root, r in m["roots"].items():
            rel = os.path.relpath(path, root)
            e = next((x for x in r["entries"] if _unhex(x["p"]) == rel), None)
            if e is None or "sha" not in e:
                continue
            old = _read_text(self._object(e["sha"]), limit)
            try:
                new = _read_text_nofollow(root, rel, limit)
            except OSError:
                new = ""
            if old is None or new is None:
                return ""
            return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                f"a/{rel}", f"b/{rel}"))
        return ""

    # ---- prune -----------------------------------------------------------------------------------

    def prune(self, keep: int) -> tuple[list[str], int]:
        """Keep the newest ``keep`` snapshots; remove the others and every object none still needs."""
        snaps = sorted(self.snapshots(), key=lambda s: s["created"])
        gone = [s["id"] for s in snaps[:max(0, len(snaps) - keep)]]
        for sid in gone:
            os.unlink(self._manifest_path(sid))
            os.unlink(self._manifest_path(sid)[:-5] + ".sha256")
        needed = {e["sha"] for s in self.snapshots() for r in self.manifest(s["id"])["roots"].values()
                  for e in r["entries"] if "sha" in e}
        removed = 0
        objects = os.path.join(self.path, "objects")
        for sub in os.listdir(objects):
            d = os.path.join(objects, sub)
            if sub.startswith(".") or not os.path.isdir(d):  # a snapshot being taken stages its content there
                continue
            for name in os.listdir(d):
                if name not in needed:
                    os.unlink(os.path.join(d, name))
                    removed += 1
        for cache in os.listdir(os.path.join(self.path, "cache")):  # may name removed objects: rebuilt
            os.unlink(os.path.join(self.path, "cache", cache))
        return gone, removed


# ---- walking and reading without following symlinks -------------------------------------------------

def _resolve_root(path: str) -> str:
    real = os.path.abspath(path)
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        raise SnapshotError("PATH", f"{path} does not exist", "give an existing directory") from None
    except OSError as e:
        raise SnapshotError("PATH", f"{path}: {e.strerror}", "snapshot it as a user who can read it") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SnapshotError("PATH", f"{path} is not a directory", "snapshot the directory it is in")
    from ..cell.paths import open_nofollow

    try:
        os.close(open_nofollow(real))
    except AgentcellError:
        raise SnapshotError("PATH", f"{path} has a symlink in it", "give the real path") from None
    return real


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _free_bytes(path: str) -> int:
    sv = os.statvfs(path)
    return sv.f_bavail * sv.f_frsize


def _walk(root: str) -> Iterator[tuple[str, os.stat_result, str | None]]:
    """(relative path, lstat, symlink target) for root and all below it, never through a symlink,
    on root's file system only; iterative (any depth)."""
    from ..accounts.acl import Walk

    for n in Walk(root, links=True):
        link = None
        if stat.S_ISLNK(n.st.st_mode) and n.parent is not None:
            link = os.readlink(n.name or "", dir_fd=n.parent)
        yield n.rel, n.st, link


def _open_below(root: str, rel: str, flags: int) -> int:
    from ..cell.paths import open_nofollow

    parent, name = os.path.split(rel)
    dfd = open_nofollow(os.path.join(root, parent) if parent else root)
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)


def _changed(e: dict[str, Any], st: os.stat_result, link: str | None, root: str, rel: str) -> bool:
    if stat.S_IFMT(st.st_mode) != stat.S_IFMT(e["mode"]) or st.st_mode != e["mode"]:
        return True
    if stat.S_ISLNK(st.st_mode):
        return os.fsencode(link or "").hex() != e.get("target")
    if stat.S_ISREG(st.st_mode):
        if [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] == e.get("stat"):
            return False
        if st.st_size != e.get("size"):
            return True
        h = hashlib.sha256()
        fd = _open_below(root, rel, os.O_RDONLY | os.O_NONBLOCK)
        try:
            while chunk := os.read(fd, CHUNK):
                h.update(chunk)
        finally:
            os.close(fd)
        return h.hexdigest() != e.get("sha")
    return False


def _read_text(path: str, limit: int) -> str | None:
    with open(path, "rb") as f:
        return _text(f.read(limit + 1), limit)


def _read_text_nofollow(root: str, rel: str, limit: int) -> str | None:
    fd = _open_below(root, rel, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return _text(os.read(fd, limit + 1), limit)
    finally:
        os.close(fd)


def _text(data: bytes, limit: int) -> str | None:
    """The data as text, or None if it is binary (a NUL, not UTF-8) or longer than ``limit``."""
    if len(data) > limit or b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def _syncfs(path: str) -> None:
    """Flush the file system holding ``path`` once (syncfs(2)), instead of an fsync per file."""
    import ctypes

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _load_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: str, data: object) -> None:
    hostfs.replace_file(path, json.dumps(data, separators=(",", ":")).encode())


# ---- restore on directory fds ----------------------------------------------------------------------

def _mkdirs_nofollow(path: str) -> None:
    """``os.makedirs`` without following a link anywhere on the way: a project directory swapped for
    a link to /etc would otherwise have root make directories there. What it makes is 0755 and
    belongs to whoever owns the directory it is made in (a restore into a person's home leaves no
    root-owned directory there); the restored root then gets its own mode and owner from the snapshot."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in path.split("/") if p]:
            try:
                made = True
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)  # never through a link: mkdirat does not follow one
                except FileExistsError:
                    made = False
                nfd = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                if made:
                    # The one made here: ours and empty (the parent's owner could have swapped the name
                    # for another directory in between; one of root's with files in it must not become theirs).
                    st, up = os.fstat(nfd), os.fstat(fd)
                    if st.st_uid != os.geteuid() or os.listdir(f"/proc/self/fd/{nfd}"):
                        os.close(nfd)
                        raise SnapshotError("PATH", f"{path}: '{part}' changed while it was made",
                                            "restore again; if it happens again, someone is racing the restore")
                    os.chown(f"/proc/self/fd/{nfd}", up.st_uid, up.st_gid)  # the directory opened, not a name
            except OSError as e:  # ELOOP, ENOTDIR: a link or a file where a directory should be
                raise SnapshotError("PATH", f"{path}: '{part}' is not a directory ({e.strerror})",
                                    "restore to a path made of real directories (a link is never followed)") from None
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


class _Restorer:
    """Make ``dest_root``/``rel`` exactly the snapshot's, walking on fds (nothing followed).

    Each file or symlink is made in a staging directory of the restorer's own (0700, made in the
    directory being restored, reached only through its fd), gets its owner, mode, ACLs and times
    there, and is renamed into place: nothing the agent can reach is ever chowned or chmodded by
    name. An existing file is kept only if its content hashes to the snapshot's (a write through a
    shared mapping changes content without a timestamp)."""

    def __init__(self, store: Store, dest_root: str, entries: dict[str, dict[str, Any]],
                 progress: Progress | None) -> None:
        self.store, self.dest_root, self.entries, self.progress = store, dest_root, entries, progress
        self.written = 0
        self.children: dict[str, list[str]] = {}
        for rel, e in entries.items():
            _check_entry(rel, e)
            if rel != ".":
                parent = os.path.dirname(rel) or "."
                self.children.setdefault(parent, []).append(os.path.basename(rel))

    def run(self, rel: str) -> int:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:  # one fd per directory level: as deep as the limit allows
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        rel = os.path.normpath(rel)
        from ..cell.paths import open_nofollow

        _mkdirs_nofollow(self.dest_root)
        top = open_nofollow(self.dest_root)
        try:
            rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=top)
        finally:
            os.close(top)
        try:
            if rel == ".":
                self._dir(rfd, ".")
                self._meta_fd(rfd, self.entries["."])
            else:
                parent, name = os.path.split(rel)
                pfd = self._descend(rfd, parent)
                try:
                    self._entry(pfd, name, rel)
                finally:
                    os.close(pfd)
        finally:
            os.close(rfd)
        return self.written

    def _descend(self, rfd: int, rel: str) -> int:
        fd = os.dup(rfd)
        for part in [p for p in rel.split("/") if p and p != "."]:
            nfd = self._ensure_dir(fd, part)
            os.close(fd)
            fd = nfd
        return fd

    def _ensure_dir(self, dfd: int, name: str) -> int:
        try:
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            if e.errno not in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):
                raise  # EMFILE, EIO, ...: never taken for "not a directory, remove it"
            self._remove(dfd, name)
            os.mkdir(name, 0o700, dir_fd=dfd)
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)

    def _dir(self, dfd: int, rel: str) -> None:
        """Iteratively: every child of ``rel`` as in the snapshot, and nothing else. A directory's fd
        stays open only while its subtree is being done (fds in use = depth, not width)."""
        stack: list[tuple[str, int, str, str]] = [("open", dfd, "", rel)]
        while stack:
            kind, fd, name, here = stack.pop()
            if kind == "done":  # children are in place: now this directory's own metadata (mtime last)
                if here != rel:
                    self._meta_fd(fd, self.entries[here])
                    os.close(fd)
                continue
            if here != rel:
                fd = self._ensure_dir(fd, name)
            want = set(self.children.get(here, []))
            for extra in os.listdir(fd):
                if extra not in want:
                    self._remove(fd, extra)
            stack.append(("done", fd, "", here))
            stage = _Stage(fd)
            try:
                for child_name in sorted(want):
                    child = child_name if here == "." else f"{here}/{child_name}"
                    e = self.entries[child]
                    if stat.S_ISDIR(e["mode"]):
                        stack.append(("open", fd, child_name, child))
                    else:
                        self._leaf(fd, child_name, e, stage)
            finally:
                stage.close()

    def _entry(self, pfd: int, name: str, rel: str) -> None:
        e = self.entries.get(rel)
        if e is None:
            self._remove(pfd, name)
        elif stat.S_ISDIR(e["mode"]):
            cfd = self._ensure_dir(pfd, name)
            try:
                self._dir(cfd, rel)
                self._meta_fd(cfd, e)
            finally:
                os.close(cfd)
        else:
            stage = _Stage(pfd)
            try:
                self._leaf(pfd, name, e, stage)
            finally:
                stage.close()

    def _same_file(self, dfd: int, name: str, e: dict[str, Any]) -> bool:
        """The existing entry is a regular file with the snapshot's content, owner, mode and ACLs."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != e["size"] or st.st_mode != e["mode"] or \
                    (st.st_uid, st.st_gid, st.st_mtime_ns) != (e["uid"], e["gid"], e["mtime"]):
                return False
            if _acls(fd) != (e.get("acl", ""), e.get("dacl", "")):
                return False
            h = hashlib.sha256()
            while chunk := os.read(fd, CHUNK):
                h.update(chunk)
            return bool(h.hexdigest() == e["sha"])
        finally:
            os.close(fd)

    def _leaf(self, dfd: int, name: str, e: dict[str, Any], stage: _Stage) -> None:
        try:
            st: os.stat_result | None = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if stat.S_ISLNK(e["mode"]):
            target = os.fsdecode(bytes.fromhex(e["target"]))
            if st is not None and stat.S_ISLNK(st.st_mode) and os.readlink(name, dir_fd=dfd) == target and \
                    (st.st_uid, st.st_gid, st.st_mtime_ns) == (e["uid"], e["gid"], e["mtime"]):
                return
            sfd, tmp = stage.fd(), stage.name()
            os.symlink(target, tmp, dir_fd=sfd)  # in the stage: nobody else can reach it by any name
            os.chown(tmp, e["uid"], e["gid"], dir_fd=sfd, follow_symlinks=False)
            os.utime(tmp, ns=(e["mtime"], e["mtime"]), dir_fd=sfd, follow_symlinks=False)
        else:
            if st is not None and stat.S_ISREG(st.st_mode) and self._same_file(dfd, name, e):
                return
            sfd, tmp = stage.fd(), stage.name()
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=sfd)
            try:
                with open(self.store._object(e["sha"]), "rb") as src:
                    while chunk := src.read(CHUNK):
                        _write_all(out, chunk)
                os.fchown(out, e["uid"], e["gid"])
                os.fchmod(out, stat.S_IMODE(e["mode"]))
                _set_acls(out, e)
                os.utime(out, ns=(e["mtime"], e["mtime"]))
            finally:
                os.close(out)
        if st is not None and stat.S_ISDIR(st.st_mode):
            self._remove(dfd, name)
        os.rename(tmp, name, src_dir_fd=sfd, dst_dir_fd=dfd)
        self.written += 1
        if self.progress:
            self.progress(self.written, len(self.entries))

    def _meta_fd(self, fd: int, e: dict[str, Any]) -> None:
        os.fchown(fd, e["uid"], e["gid"])
        os.fchmod(fd, stat.S_IMODE(e["mode"]))
        _set_acls(fd, e)
        os.utime(fd, ns=(e["mtime"], e["mtime"]))

    def _remove(self, dfd: int, name: str) -> None:
        """Remove an entry whatever it is, without following anything: rm on the parent's fd."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dfd)
            return
        import subprocess

        # GNU rm walks with openat/O_NOFOLLOW; given our directory fd, no name above it is looked up.
        p = subprocess.run(["rm", "-rf", "--one-file-system", "--", f"/proc/self/fd/{dfd}/{name}"],
                           pass_fds=(dfd,), capture_output=True, text=True)
        if p.returncode != 0 or os.path.lexists(f"/proc/self/fd/{dfd}/{name}"):
            raise SnapshotError("restore", f"cannot remove {name!r}: {p.stderr.strip()}")


class _Stage:
    """A private directory (0700) inside a directory being restored, made on first use and removed
    after: new entries are finished in it, then renamed into place."""

    def __init__(self, parent: int) -> None:
        self.parent, self._fd, self._name, self.n = parent, -1, "", 0

    def fd(self) -> int:
        if self._fd < 0:
            self._name = f".agentcell-restore-{os.urandom(6).hex()}"
            os.mkdir(self._name, 0o700, dir_fd=self.parent)
            self._fd = os.open(self._name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                               dir_fd=self.parent)
        return self._fd

    def name(self) -> str:
        self.n += 1
        return f"e{self.n}"

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            try:
                os.rmdir(self._name, dir_fd=self.parent)
            except OSError:
                pass  # moved or filled by someone else meanwhile: what is in it is theirs or empty


def _acls(fd: int) -> tuple[str, str]:
    from ..accounts.acl import ACCESS, DEFAULT, _raw

    return _raw(fd, ACCESS).hex(), _raw(fd, DEFAULT).hex()


def _set_acls(fd: int, e: dict[str, Any]) -> None:
    """Exactly the snapshot's ACLs (none if it had none): an agent's added entries do not survive.
    Set after fchmod: an access ACL decides the mode's group bits itself."""
    from ..accounts.acl import ACCESS, DEFAULT

    for key, which in (("acl", ACCESS), ("dacl", DEFAULT)):
        want = bytes.fromhex(e[key]) if e.get(key) else None
        try:
            if want is not None:
                os.setxattr(f"/proc/self/fd/{fd}", which, want)
            else:
                os.removexattr(f"/proc/self/fd/{fd}", which)
        except OSError as err:  # nothing to remove (or a file, which has no default ACL): fine
            if want is not None or err.errno not in (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EACCES):
                raise


def _check_entry(rel: str, e: dict[str, Any]) -> None:
    """A manifest is ours, but it is read as untrusted: a name that climbs out or a missing field
    stops the restore before anything is touched."""
    parts = rel.split("/")
    if rel != "." and (not rel or "\0" in rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts)):
        raise SnapshotError("ID", f"the manifest names {rel!r}, which is not a path inside its root",
                            "the store is damaged; restore another snapshot")
    needed = ("mode", "uid", "gid", "mtime", *(("sha", "size") if stat.S_ISREG(e.get("mode", 0)) else ()),
              *(("target",) if stat.S_ISLNK(e.get("mode", 0)) else ()))
    if any(k not in e for k in needed):
        raise SnapshotError("ID", f"the manifest's entry for {rel!r} is incomplete",
                            "the store is damaged; restore another snapshot")


__all__ = ["SnapshotError", "Store", "default_store"]
