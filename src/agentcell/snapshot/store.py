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
still read again. Our own ACL writes move it too (a session's grant and revoke, on every file):
:meth:`Store.carry` re-keys the files whose content cannot have changed, so that a session's
backup reads only what its predecessor's agent (or anyone) changed.

Here: the store and what it does (take, verify, diff, prune); :mod:`.restore` makes a tree the
snapshot's, :mod:`.files` reads and writes without following links.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from typing import Any

from .. import hostfs
from ..errors import AgentcellError
from .base import Progress, SnapshotError, _hexpath, _unhex
from .files import (
    CHUNK,
    _free_bytes,
    _key,
    _load_json,
    _open_below,
    _read_text,
    _read_text_nofollow,
    _syncfs,
    _walk,
    _write_all,
    _write_json,
)
from .restore import _Restorer

STORE_DIRS = ("objects", "snapshots", "cache")  # what a store holds, and all it holds
CARRY_AGE_NS = 1_000_000_000  # Store.carry: an mtime this much older than the change it survived


def default_store() -> str:
    from ..hostfs import state_dir

    return os.environ.get("BACKUP_DIR") or os.path.join(state_dir(), "snapshots")


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
        # (not os.path.join: a take of 20,000 known files asks for each one's)
        return f"{self.path.rstrip('/')}/objects/{digest[:2]}/{digest}"

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
            cache_path = self._cache_path(root)
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
                if not stat.S_ISLNK(st.st_mode):  # (only a directory has a default ACL)
                    for key_name, which in (("acl", ACCESS), ("dacl", DEFAULT))[:2 if stat.S_ISDIR(st.st_mode) else 1]:
                        raw = _raw(n.fd, which)
                        if raw:
                            e[key_name] = raw.hex()
                if stat.S_ISREG(st.st_mode):
                    key = _stat_key(st)
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

    def _cache_path(self, root: str) -> str:
        """The cache of what the last snapshot of ``root`` knew of each file (by its stat)."""
        return os.path.join(self.path, "cache", hashlib.sha256(os.fsencode(root)).hexdigest() + ".json")

    # ---- carry -----------------------------------------------------------------------------------

    def carry(self, root: str, changes: list[tuple[str, os.stat_result, os.stat_result]], owners: set[int]) -> int:
        """Files whose ACL we just wrote (a session's grant or revoke, :data:`agentcell.accounts.acl.Changed`):
        (path below ``root``, stat before, stat after). The write moved their ctime, so the next take would
        read them all again; a file the cache knows at its stat before keeps its content under its stat
        after, when nothing but its ctime moved and nobody could have changed the content meanwhile while
        keeping its size and mtime: its owner is one of ``owners`` (only the owner or root sets an mtime
        at will), and its mtime is more than a second older than the change (a write in the same tick
        as the last one, on a file system with coarse timestamps, leaves the mtime as it was). The rest
        is read again next time. The changes are taken in order: a file may come once per write (a
        grant's, then a revoke's). How many were carried; a cache that cannot be read or written
        carries none."""
        root = os.path.abspath(root)
        cache_path = self._cache_path(root)
        cache = _load_json(cache_path)
        carried = 0
        for rel, before, after in changes:
            key = _hexpath(rel)
            hit = cache.get(key)
            if hit is None or hit[:4] != _stat_key(before):
                continue
            if (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns, after.st_uid) != \
                    (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns, before.st_uid) \
                    or before.st_uid not in owners or before.st_mtime_ns >= after.st_ctime_ns - CARRY_AGE_NS:
                continue
            cache[key] = [*_stat_key(after), hit[4]]
            carried += 1
        if carried:
            try:
                _write_json(cache_path, cache)
            except OSError:
                return 0
        return carried

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
                written += _Restorer(self._object, dest_root, entries, progress).run(rel)
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


def _stat_key(st: os.stat_result) -> list[int]:
    """What a file's content is known by, until one of them moves: size, mtime, ctime, inode."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _changed(e: dict[str, Any], st: os.stat_result, link: str | None, root: str, rel: str) -> bool:
    if stat.S_IFMT(st.st_mode) != stat.S_IFMT(e["mode"]) or st.st_mode != e["mode"]:
        return True
    if stat.S_ISLNK(st.st_mode):
        return os.fsencode(link or "").hex() != e.get("target")
    if stat.S_ISREG(st.st_mode):
        if _stat_key(st) == e.get("stat"):
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


__all__ = ["SnapshotError", "Store", "default_store"]
