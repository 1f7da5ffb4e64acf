"""The cell's mount tree: planned on the supervisor side (paths opened once, as fds), applied in the child.

Every bind is nosuid,nodev; system dirs, ``--ro`` paths and secrets are read-only; the root is a
tmpfs made read-only before ``pivot_root``. ``describe()`` is what ``--explain`` prints.
"""
from __future__ import annotations

import os
import stat

from ..errors import LaunchError
from . import syscalls as sc
from .paths import fd_path, open_nofollow
from .spec import SCRATCH_PATH, SECRET_DIRS, SECRET_FILES, CellSpec

_STAGE = "/tmp"  # in the cell's private mount namespace only: a tmpfs is mounted over it
NEWROOT = "/tmp/newroot"
_EMPTY_FILE = "/tmp/empty-file"
_EMPTY_DIR = "/tmp/empty-dir"
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")

# statvfs f_flag bit -> mount flag; a bind remount must keep the flags the source mount has locked
_ST_TO_MS = {
    os.ST_RDONLY: sc.MS_RDONLY,
    os.ST_NOSUID: sc.MS_NOSUID,
    os.ST_NODEV: sc.MS_NODEV,
    os.ST_NOEXEC: sc.MS_NOEXEC,
    os.ST_SYNCHRONOUS: sc.MS_SYNCHRONOUS,
    os.ST_MANDLOCK: sc.MS_MANDLOCK,
    os.ST_NOATIME: sc.MS_NOATIME,
    os.ST_NODIRATIME: sc.MS_NODIRATIME,
    os.ST_RELATIME: sc.MS_RELATIME,
}
SAFE = sc.MS_NOSUID | sc.MS_NODEV


class Step:
    """One mount-tree operation. ``dest`` is the path inside the cell.

    kind: tmpfs | bind | devnode | symlink | proc | devpts | mask. ``source`` is the host path (bind),
    the link target (symlink) or a label; ``submounts`` are host mount points below a bind source,
    remounted as strictly as it; ``src_id`` is the (st_dev, st_ino) the supervisor resolved.
    """

    def __init__(self, kind: str, dest: str, source: str = "", *, readonly: bool = True, is_dir: bool = True,
                 flags: int = 0, data: str = "", submounts: tuple[str, ...] = ()) -> None:
        self.kind, self.dest, self.source = kind, dest, source
        self.readonly, self.is_dir, self.flags, self.data = readonly, is_dir, flags or SAFE, data
        self.submounts = submounts
        self.src_fd = -1
        self.src_id = (0, 0)

    def describe(self) -> str:
        if self.kind == "bind":
            mode = "ro" if self.readonly else "rw"
            sub = f" (+{len(self.submounts)} submounts)" if self.submounts else ""
            return f"bind {mode},nosuid,nodev {self.source} -> {self.dest}{sub}"
        if self.kind == "symlink":
            return f"symlink {self.dest} -> {self.source}"
        if self.kind == "mask":
            what = "empty dir" if self.is_dir else "empty mode-000 file"
            return f"mask {self.dest} (ro {what})"
        opts = ",".join(x for x in ("ro" if self.readonly else "rw", "nosuid", "nodev", self.data) if x)
        return f"{self.kind} {self.dest} ({opts})"


class MountPlan:
    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps

    def open_sources(self) -> None:
        """Re-open every bind source in the cell's mount namespace (a bind source must be a mount of
        the caller's namespace), never following a symlink, and refuse if it is no longer the very
        file the supervisor resolved."""
        for s in self.steps:
            if s.kind != "bind":
                continue
            s.src_fd = open_nofollow(s.source)
            st = os.fstat(s.src_fd)
            if (st.st_dev, st.st_ino) != s.src_id:
                raise LaunchError("resolve", f"{s.source} was replaced after it was resolved; refusing to bind it")

    def close(self) -> None:
        for s in self.steps:
            if s.src_fd >= 0:
                os.close(s.src_fd)
                s.src_fd = -1

    def describe(self) -> list[str]:
        return [s.describe() for s in self.steps]


def _mountpoints() -> list[str]:
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            mp = line.split(b" ", 5)[4]
            out.append(os.fsdecode(mp).replace("\\040", " "))
    return out


def _depth(p: str) -> int:
    return p.rstrip("/").count("/")


def plan(spec: CellSpec, *, open_fds: bool = True) -> MountPlan:
    """Build the ordered mount steps for ``spec``. With ``open_fds`` every source is opened now."""
    mps = _mountpoints()
    steps: list[Step] = []
    mine: list[Step] = []  # user-declared paths, ordered by depth below

    def bind(src: str, dest: str, ro: bool) -> Step:
        st = os.lstat(src)
        subs = tuple(m for m in mps if m.startswith(src.rstrip("/") + "/"))
        s = Step("bind", dest, src, readonly=ro, is_dir=stat.S_ISDIR(st.st_mode), submounts=subs)
        if open_fds:
            fd = open_nofollow(src)
            try:
                fst = os.fstat(fd)
            finally:
                os.close(fd)
            s.src_id = (fst.st_dev, fst.st_ino)
        return s

    for p in spec.system_paths:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            steps.append(Step("symlink", p, os.readlink(p)))
        elif stat.S_ISDIR(st.st_mode):
            steps.append(bind(p, p, True))
    for p in SECRET_FILES + SECRET_DIRS:
        if any(p.startswith(s.rstrip("/") + "/") for s in spec.system_paths) and os.path.lexists(p):
            steps.append(Step("mask", p, is_dir=os.path.isdir(p) and not os.path.islink(p)))

    steps.append(Step("proc", "/proc", "proc", readonly=False, flags=SAFE | sc.MS_NOEXEC, data="hidepid=invisible"))
    steps.append(Step("tmpfs", "/dev", "tmpfs", readonly=False, flags=sc.MS_NOSUID | sc.MS_NOEXEC, data="mode=0755"))
    for n in DEV_NODES:
        steps.append(Step("devnode", f"/dev/{n}", f"/dev/{n}", readonly=False, is_dir=False,
                          flags=sc.MS_NOSUID | sc.MS_NOEXEC))
    pts = "newinstance,ptmxmode=0666,mode=0620" + ("" if spec.identity.userns else ",gid=5")
    steps.append(Step("devpts", "/dev/pts", "devpts", readonly=False, flags=sc.MS_NOSUID | sc.MS_NOEXEC, data=pts))
    steps.append(Step("symlink", "/dev/ptmx", "pts/ptmx"))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        steps.append(Step("symlink", f"/dev/{name}", target))
    steps.append(Step("tmpfs", "/dev/shm", "tmpfs", readonly=False, data="mode=1777"))
    steps.append(Step("tmpfs", "/tmp", "tmpfs", readonly=False, data="mode=1777"))

    ident = spec.identity
    owner = f"mode=0700,uid={ident.uid},gid={ident.gid}"
    if spec.home_dir:
        mine.append(bind(spec.home_dir, ident.home, False))
    else:
        mine.append(Step("tmpfs", ident.home, "tmpfs", readonly=False, data=owner))
    if spec.scratch_dir:
        mine.append(bind(spec.scratch_dir, SCRATCH_PATH, False))
    else:
        mine.append(Step("tmpfs", SCRATCH_PATH, "tmpfs", readonly=False, data=owner))
    for p in spec.rw_paths:
        mine.append(bind(p, p, False))
    for p in spec.ro_paths:
        mine.append(bind(p, p, True))
    for p in spec.masked_paths:
        mine.append(Step("mask", p, is_dir=os.path.isdir(p)))
    # Parents before children; at equal depth masks last so they cover what was bound.
    mine.sort(key=lambda s: (_depth(s.dest), s.kind == "mask"))
    return MountPlan(steps + mine)


# ---- child side -------------------------------------------------------------------------------


def _locked_flags(path: str) -> int:
    f = os.statvfs(path).f_flag
    return sum(ms for st, ms in _ST_TO_MS.items() if f & st)


def _target(rel: str, is_dir: bool, root_fd: int) -> int:
    """Open (creating if missing) ``rel`` under the new root, never following a symlink."""
    parts = [p for p in rel.split("/") if p]
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nfd = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if last and not is_dir:
                    os.close(os.open(part, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     0o000, dir_fd=fd))
                else:
                    os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise LaunchError("mount", f"{rel}: a path component is a symlink inside the cell; "
                                  "refusing to follow it")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _bind(src: str, dest: str, root_fd: int, is_dir: bool, flags: int, readonly: bool) -> None:
    keep = _locked_flags(src)
    fd = _target(dest, is_dir, root_fd)
    try:
        sc.mount(src, fd_path(fd), None, sc.MS_BIND | sc.MS_REC)
    finally:
        os.close(fd)
    # The fd above names the directory *under* the new mount; re-open to reach the bind itself.
    fd = _target(dest, is_dir, root_fd)
    try:
        ro = sc.MS_RDONLY if readonly else 0
        sc.mount(None, fd_path(fd), None, sc.MS_BIND | sc.MS_REMOUNT | keep | flags | ro)
    finally:
        os.close(fd)


def apply(plan_: MountPlan) -> None:
    """Build the tree under NEWROOT. Runs in the cell's mount namespace, before pivot_root."""
    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
    plan_.open_sources()  # before the staging tmpfs hides the host's /tmp
    sc.mount("tmpfs", _STAGE, "tmpfs", SAFE | sc.MS_NOEXEC, "mode=0711,size=64k")
    os.close(os.open(_EMPTY_FILE, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o000))
    os.mkdir(_EMPTY_DIR, 0o000)
    os.mkdir(NEWROOT, 0o755)
    sc.mount("tmpfs", NEWROOT, "tmpfs", SAFE, "mode=0755")
    root_fd = os.open(NEWROOT, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for s in plan_.steps:
            try:
                _apply_one(s, root_fd)
            except OSError as e:
                raise LaunchError("mount", f"{s.describe()}: {e.strerror}") from None
    finally:
        os.close(root_fd)


def _apply_one(s: Step, root_fd: int) -> None:
    if s.kind == "symlink":
        parent = _target(os.path.dirname(s.dest), True, root_fd)
        try:
            os.symlink(s.source, os.path.basename(s.dest), dir_fd=parent)
        finally:
            os.close(parent)
    elif s.kind == "bind":
        _bind(fd_path(s.src_fd), s.dest, root_fd, s.is_dir, s.flags, s.readonly)
        for sub in s.submounts:
            # A submount keeps its own flags after MS_REC; make it as strict as its parent bind.
            rel = s.dest.rstrip("/") + sub[len(s.source.rstrip("/")):]
            fd = _target(rel, True, root_fd)
            try:
                ro = sc.MS_RDONLY if s.readonly else 0
                keep = _locked_flags(fd_path(fd))
                sc.mount(None, fd_path(fd), None, sc.MS_BIND | sc.MS_REMOUNT | keep | s.flags | ro)
            finally:
                os.close(fd)
    elif s.kind == "devnode":
        _bind(s.source, s.dest, root_fd, False, s.flags, False)
    elif s.kind == "mask":
        _bind(_EMPTY_DIR if s.is_dir else _EMPTY_FILE, s.dest, root_fd, s.is_dir, SAFE | sc.MS_NOEXEC, True)
    elif s.kind in ("tmpfs", "proc", "devpts"):
        fd = _target(s.dest, True, root_fd)
        try:
            sc.mount(s.source, fd_path(fd), s.kind, s.flags, s.data or None)
        finally:
            os.close(fd)
    else:
        raise LaunchError("mount", f"unknown step kind {s.kind}")


def pivot() -> None:
    """Make the new root read-only, pivot into it and detach the host's tree."""
    sc.mount(None, NEWROOT, None, sc.MS_BIND | sc.MS_REMOUNT | sc.MS_RDONLY | SAFE)
    os.chdir(NEWROOT)
    sc.pivot_root(".", ".")
    sc.umount2(".", sc.MNT_DETACH)
    os.chdir("/")
