"""Restores are exact and in place by default: content, modes, owners, mtimes, symlinks (recreated,
never followed), empty directories, and whatever was added since the snapshot is removed. A restore
runs as root on a tree the agent wrote, so it walks on directory fds opened with O_NOFOLLOW (a
directory the agent swapped for a symlink is replaced, not followed); a file is written to a new
name beside its destination and renamed over it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable
from typing import Any

from .base import Progress, SnapshotError
from .files import CHUNK, _write_all


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

    def __init__(self, objects: Callable[[str], str], dest_root: str, entries: dict[str, dict[str, Any]],
                 progress: Progress | None) -> None:
        # objects: a content hash -> its file in the store
        self.objects, self.dest_root, self.entries, self.progress = objects, dest_root, entries, progress
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
                with open(self.objects(e["sha"]), "rb") as src:
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
