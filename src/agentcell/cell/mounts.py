"""The cell's mount tree: planned on the supervisor side (paths opened once, as fds), applied in the child.

Every bind is nosuid,nodev; system dirs, ``--ro`` paths and secrets are read-only; the root is a
tmpfs made read-only before ``pivot_root``. ``describe()`` is what ``--explain`` prints.
"""
from __future__ import annotations

import os
import stat

from .. import hostfs
from ..errors import LaunchError
from . import syscalls as sc
from .cgroups import default_memory
from .paths import fd_path, open_nofollow
from .spec import CACHE_PATH, SCRATCH_PATH, SECRET_DIRS, SECRET_FILES, TYPE_CHECKING, CellSpec, Workspace

if TYPE_CHECKING:
    from collections.abc import Sequence

_STAGE = "/tmp"  # in the cell's private mount namespace only: a tmpfs is mounted over it
NEWROOT = "/tmp/newroot"
_EMPTY_FILE = "/tmp/empty-file"
_EMPTY_DIR = "/tmp/empty-dir"
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")

SAFE = sc.MS_NOSUID | sc.MS_NODEV
MAX_GUARDED = 1024  # protected binds per cell: beyond, something planted them (fail closed, say so)
# Attributes set on a bind while it is still detached (mount_setattr), so it is never visible with
# fewer: a racing rename can move where a bind lands, never make a read-only one writable.
ATTR_RO = sc.MOUNT_ATTR_RDONLY | sc.MOUNT_ATTR_NOSUID | sc.MOUNT_ATTR_NODEV
ATTR_RW = sc.MOUNT_ATTR_NOSUID | sc.MOUNT_ATTR_NODEV
ATTR_DEVNODE = sc.MOUNT_ATTR_NOSUID | sc.MOUNT_ATTR_NOEXEC
ATTR_MASK = ATTR_RO | sc.MOUNT_ATTR_NOEXEC


class Step:
    """One mount-tree operation. ``dest`` is the path inside the cell.

    kind: tmpfs | bind | devnode | symlink | proc | devpts | mask | overlay. ``source`` is the host path (bind,
    overlay: its read-only lower layer),
    the link target (symlink) or a label. ``dest_id``: the (st_dev, st_ino) the supervisor saw at
    ``dest`` on the host (for a bind at its own path, and a mask); the mount is attached only to
    that very file, never to whatever a racing rename put under the name.
    A bind covers the source's submounts too (recursive), each as read-only as the bind.
    """

    def __init__(self, kind: str, dest: str, source: str = "", *, readonly: bool = True, is_dir: bool = True,
                 flags: int = 0, data: str = "") -> None:
        self.kind, self.dest, self.source = kind, dest, source
        self.readonly, self.is_dir, self.flags, self.data = readonly, is_dir, flags or SAFE, data
        self.src_fd = -1
        self.src_id = (0, 0)
        self.dest_id: tuple[int, int] | None = None
        self.workspace: Workspace | None = None  # overlay: its layers
        self.layer_fds: list[int] = []  # overlay: upper, work (and hide), opened in the cell
        self.userns_fd = -1  # overlay with an idmap: the mapping's user namespace (made on the supervisor's side)

    def describe(self) -> str:
        if self.kind == "overlay" and self.workspace is not None:
            ws = self.workspace
            idmap = f", owner {ws.idmap[0]}:{ws.idmap[1]} shown as the cell's account" if ws.idmap else ""
            hide = f", what git ignores hidden ({ws.hide})" if ws.hide else ""
            return (f"overlay nosuid,nodev {self.dest}: copy-on-write over {self.source} (read-only{idmap}{hide}), "
                    f"writes to {ws.upper}")
        if self.kind == "bind":
            mode = "ro" if self.readonly else "rw"
            return f"bind {mode},nosuid,nodev {self.source} -> {self.dest}"
        if self.kind == "symlink":
            return f"symlink {self.dest} -> {self.source}"
        if self.kind == "mask":
            what = "empty dir" if self.is_dir else "empty mode-000 file"
            return f"mask {self.dest} (ro {what})"
        if self.kind == "devnode":
            return f"bind {self.source} -> {self.dest} (nosuid,noexec)"
        names = ((sc.MS_NOSUID, "nosuid"), (sc.MS_NODEV, "nodev"), (sc.MS_NOEXEC, "noexec"))
        opts = ["ro" if self.readonly else "rw", *(n for bit, n in names if self.flags & bit), self.data]
        return f"{self.kind} {self.dest} ({','.join(x for x in opts if x)})"


class MountPlan:
    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps

    def open_sources(self) -> None:
        """Re-open every bind source in the cell's mount namespace (a bind source must be a mount of
        the caller's namespace), never following a symlink, and refuse if it is no longer the very
        file the supervisor resolved."""
        for s in self.steps:
            if s.kind not in ("bind", "overlay"):
                continue
            s.src_fd = open_nofollow(s.source)
            if s.workspace is not None:
                ws = s.workspace
                s.layer_fds = [open_nofollow(p) for p in (ws.upper, ws.work, *((ws.hide,) if ws.hide else ()))]
            st = os.fstat(s.src_fd)
            if (st.st_dev, st.st_ino) != s.src_id:
                raise LaunchError("resolve", f"{s.source} was replaced after it was resolved; refusing to bind it")

    def close(self) -> None:
        for s in self.steps:
            if s.src_fd >= 0:
                os.close(s.src_fd)
                s.src_fd = -1
            for fd in s.layer_fds:
                os.close(fd)
            s.layer_fds = []
        self.release()

    def describe(self) -> list[str]:
        return [s.describe() for s in self.steps]

    def kept_fds(self) -> set[int]:
        """What the plan holds open from the supervisor's side into the cell (idmaps' namespaces)."""
        return {s.userns_fd for s in self.steps if s.userns_fd >= 0}

    def release(self) -> None:
        """The supervisor's copies of :meth:`kept_fds`, once the cell has its own (or failed)."""
        for s in self.steps:
            if s.userns_fd >= 0:
                os.close(s.userns_fd)
                s.userns_fd = -1


def _only_root_renames_in(d: str) -> bool:
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and hostfs.changeable_only_by(st, hostfs.ROOT)


def _depth(p: str) -> int:
    return p.rstrip("/").count("/")


def plan(spec: CellSpec, guarded: Sequence[tuple[str, bool]], hidden: Sequence[str]) -> MountPlan:
    """Build the ordered mount steps for ``spec``; every bind source is opened (no symlinks) and its
    identity recorded now, and checked again in the cell. What policy adds comes from its caller
    (:func:`agentcell.protect.binds.for_cell`): ``guarded``, entries inside the writable paths bound
    onto themselves, (path, read-only); ``hidden``, more host paths masked like the secrets."""
    steps: list[Step] = []
    mine: list[Step] = []  # user-declared paths, ordered by depth below

    seen: dict[tuple[int, int], str] = {}

    def mask(p: str, dest: str | None = None) -> Step:
        fd = open_nofollow(p)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        s = Step("mask", dest or p, is_dir=stat.S_ISDIR(st.st_mode))
        s.dest_id = (st.st_dev, st.st_ino)
        return s

    def bind(src: str, dest: str, ro: bool, declared: bool = True) -> Step:
        fd = open_nofollow(src)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        s = Step("bind", dest, src, readonly=ro, is_dir=stat.S_ISDIR(st.st_mode))
        s.src_id = (st.st_dev, st.st_ino)
        if dest == src:
            s.dest_id = s.src_id
        if declared:  # protected entries may be hard links of each other: each name is bound
            if s.src_id in seen:  # e.g. a symlink swapped in between two declarations
                raise LaunchError("resolve", f"{src} and {seen[s.src_id]} are the same directory; declare it once")
            seen[s.src_id] = src
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

    steps.append(Step("proc", "/proc", "proc", readonly=False, flags=SAFE | sc.MS_NOEXEC, data="hidepid=invisible"))
    steps.append(Step("tmpfs", "/dev", "tmpfs", readonly=False, flags=sc.MS_NOSUID | sc.MS_NOEXEC, data="mode=0755"))
    for n in DEV_NODES:
        steps.append(Step("devnode", f"/dev/{n}", f"/dev/{n}", readonly=False, is_dir=False))  # ATTR_DEVNODE
    pts = "newinstance,ptmxmode=0666,mode=0620" + ("" if spec.identity.userns else ",gid=5")
    steps.append(Step("devpts", "/dev/pts", "devpts", readonly=False, flags=sc.MS_NOSUID | sc.MS_NOEXEC, data=pts))
    steps.append(Step("symlink", "/dev/ptmx", "pts/ptmx"))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        steps.append(Step("symlink", f"/dev/{name}", target))
    # Each writable tmpfs holds at most a quarter of the cell's memory ceiling: in a cgroup its pages
    # are charged to the cell anyway; without one (rootless) this is the only bound on them.
    size = f"size={(spec.memory_max or default_memory()) // 4 // 4096 * 4096}"
    steps.append(Step("tmpfs", "/dev/shm", "tmpfs", readonly=False, data=f"mode=1777,{size}"))
    steps.append(Step("tmpfs", "/tmp", "tmpfs", readonly=False, data=f"mode=1777,{size}"))

    ident = spec.identity
    owner = f"mode=0700,uid={ident.uid},gid={ident.gid},{size}"
    if spec.home_dir:
        mine.append(bind(spec.home_dir, ident.home, False))
    else:
        mine.append(Step("tmpfs", ident.home, "tmpfs", readonly=False, data=owner))
    if spec.scratch_dir:
        mine.append(bind(spec.scratch_dir, SCRATCH_PATH, False))
    else:
        mine.append(Step("tmpfs", SCRATCH_PATH, "tmpfs", readonly=False, data=owner))
    if spec.cache_dir:
        mine.append(bind(spec.cache_dir, CACHE_PATH, False))
    for p in spec.rw_paths:
        if spec.workspace is not None and p == spec.workspace.project:
            step = bind(p, p, False)
            step.kind, step.workspace = "overlay", spec.workspace
            if spec.workspace.idmap:  # here, in the host's PID namespace, whose /proc the maps are written to
                from . import idmap

                ws = spec.workspace
                step.userns_fd = idmap.userns_fd((ws.idmap[0], ws.idmap[2]), (ws.idmap[1], ws.idmap[3]))
            mine.append(step)
        else:
            mine.append(bind(p, p, False))
    system = {s.dest for s in steps if s.kind == "bind"}
    for p in spec.ro_paths:
        if p not in system:  # --ro /etc: the system bind already is that, read-only
            mine.append(bind(p, p, True))
    for p in spec.masked_paths:
        mine.append(mask(p))
    declared = {*spec.rw_paths, *spec.ro_paths, *spec.masked_paths}
    if len(guarded) > MAX_GUARDED:
        raise LaunchError("protect", f"{len(guarded)} protected entries in the writable paths (the most is "
                          f"{MAX_GUARDED})", "look for planted repositories; --allow-write lifts entries")
    for p, ro in guarded:
        if p not in declared:
            mine.append(bind(p, p, ro, declared=False))
            declared.add(p)
    # Parents before children; at equal depth masks last so they cover what was bound.
    mine.sort(key=lambda s: (_depth(s.dest), s.kind == "mask"))
    # The host's secrets last, wherever a bind (system or declared, e.g. --ro /etc) brought them in,
    # and what the policy hides too.
    secrets = []
    for p in (*SECRET_FILES, *SECRET_DIRS, *hidden):
        if not os.path.exists(p) or os.path.islink(p):
            continue
        for s in steps + mine:  # where a bind brings it in: at the same place below the bind's target
            src = s.source.rstrip("/")
            if s.kind == "bind" and (p == src or p.startswith(src + "/")):
                step = mask(p, s.dest.rstrip("/") + p[len(src):])
                if _only_root_renames_in(os.path.dirname(p)):
                    # useradd & co. replace /etc/shadow by a rename at any time: whatever file holds
                    # the name when the cell is built is the one to hide (the mount goes on the file
                    # found without following links). The identity check stays where someone other
                    # than root could swap the name and uncover the file it hid.
                    step.dest_id = None
                secrets.append(step)
                break
    return MountPlan(steps + mine + secrets)


# ---- child side -------------------------------------------------------------------------------


def _target(rel: str, is_dir: bool, root_fd: int, owned: set[int]) -> int:
    """Open ``rel`` under the new root, never following a symlink. Missing components are created
    only on filesystems this launch mounted (``owned`` st_dev): never inside a host directory."""
    parts = [p for p in rel.split("/") if p]
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nfd = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if os.fstat(fd).st_dev not in owned:
                    raise LaunchError("mount", f"{rel}: {part} vanished from a shared host directory") from None
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


def _bind(src_dirfd: int, src_path: str, dest: str, is_dir: bool, attrs: int, root_fd: int, owned: set[int],
          dest_id: tuple[int, int] | None = None) -> None:
    """Clone the source tree, set ``attrs`` on every mount in it while detached, attach it at ``dest``.

    Where ``dest`` lies in a shared host directory (a --ro or --mask inside a --rw path), its name
    could be swapped by a process outside the cell; the mount goes on only if the file found there
    is still ``dest_id``, and then it stays with that file through any later rename."""
    tree = sc.open_tree(src_dirfd, src_path, sc.OPEN_TREE_CLONE | sc.AT_RECURSIVE | sc.AT_SYMLINK_NOFOLLOW
                        | (sc.AT_EMPTY_PATH if not src_path else 0))
    try:
        sc.mount_setattr(tree, sc.AT_RECURSIVE, attrs)
        target = _target(dest, is_dir, root_fd, owned)
        try:
            st = os.fstat(target)
            if st.st_dev not in owned and dest_id is not None and (st.st_dev, st.st_ino) != dest_id:
                raise LaunchError("mount", f"{dest} was replaced while the cell was built; refusing to mount on it")
            sc.move_mount(tree, target)
        finally:
            os.close(target)
    finally:
        os.close(tree)


def _overlay(s: Step, root_fd: int, owned: set[int]) -> None:
    """The project as a copy-on-write view: its tree cloned (only its own mount: overlayfs does not
    cross into submounts), idmapped to the cell's account where the project is someone else's, held
    at a staging name while overlayfs takes it as its read-only lower layer, then let go of there
    (overlayfs keeps private clones of its layers). Upper, work and hide are given by file
    descriptor: no name in the store is looked up again."""
    ws = s.workspace
    assert ws is not None
    tree = sc.open_tree(s.src_fd, "", sc.OPEN_TREE_CLONE | sc.AT_EMPTY_PATH)
    try:
        if ws.idmap:
            sc.mount_setattr(tree, 0, ATTR_RO | sc.MOUNT_ATTR_IDMAP, s.userns_fd)
        else:
            sc.mount_setattr(tree, 0, ATTR_RO)
        stage = os.path.join(_STAGE, "workspace-lower")
        os.mkdir(stage, 0o700)
        target = os.open(stage, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            sc.move_mount(tree, target)
        finally:
            os.close(target)
    finally:
        os.close(tree)
    upper, work, *hide = (fd_path(fd) for fd in s.layer_fds)
    opts = f"lowerdir={':'.join((*hide, stage))},upperdir={upper},workdir={work}" + (",userxattr" if ws.userxattr
                                                                                     else "")
    dest = _target(s.dest, True, root_fd, owned)
    try:
        st = os.fstat(dest)
        if st.st_dev not in owned and s.dest_id is not None and (st.st_dev, st.st_ino) != s.dest_id:
            raise LaunchError("mount", f"{s.dest} was replaced while the cell was built; refusing to mount on it")
        sc.mount("overlay", fd_path(dest), "overlay", SAFE, opts)
    finally:
        os.close(dest)
        sc.umount2(stage, sc.MNT_DETACH)


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
    owned = {os.fstat(root_fd).st_dev}
    try:
        for s in plan_.steps:
            try:
                _apply_one(s, root_fd, owned)
            except OSError as e:
                raise LaunchError("mount", f"{s.describe()}: {e.strerror}") from None
    finally:
        os.close(root_fd)


def _apply_one(s: Step, root_fd: int, owned: set[int]) -> None:
    if s.kind == "symlink":
        parent = _target(os.path.dirname(s.dest), True, root_fd, owned)
        try:
            os.symlink(s.source, os.path.basename(s.dest), dir_fd=parent)
        finally:
            os.close(parent)
    elif s.kind == "bind":
        _bind(s.src_fd, "", s.dest, s.is_dir, ATTR_RO if s.readonly else ATTR_RW, root_fd, owned, s.dest_id)
    elif s.kind == "overlay":
        _overlay(s, root_fd, owned)
    elif s.kind == "devnode":
        _bind(sc.AT_FDCWD, s.source, s.dest, False, ATTR_DEVNODE, root_fd, owned)
    elif s.kind == "mask":
        for attempt in range(20):
            try:
                _bind(sc.AT_FDCWD, _EMPTY_DIR if s.is_dir else _EMPTY_FILE, s.dest, s.is_dir, ATTR_MASK, root_fd,
                      owned, s.dest_id)
                return
            except FileNotFoundError:
                # A file only root can rename (dest_id None: /etc/shadow while useradd runs) was renamed
                # over between our open and the mount: mask whatever holds the name now.
                if s.dest_id is not None or attempt == 19:
                    raise
    elif s.kind in ("tmpfs", "proc", "devpts"):
        fd = _target(s.dest, True, root_fd, owned)
        try:
            sc.mount(s.source, fd_path(fd), s.kind, s.flags, s.data or None)
        finally:
            os.close(fd)
        fd = _target(s.dest, True, root_fd, owned)  # the new mount itself, not the directory under it
        try:
            owned.add(os.fstat(fd).st_dev)
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


def send_root(ctl: object) -> None:
    """PID 1, after pivot_root, under a monitor: the cell's root and its mount namespace, to the
    supervisor. A namespace ends with its last reference, not its last process: held there, the tree
    stays as the cell left it, and a failed call the monitor reads after the cell is over (a loaded host)
    is still walked where it stood (a link in the project to a key outside)."""
    from . import handoff

    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        try:
            handoff.send_fds(ctl, [root, ns], b"R")  # type: ignore[arg-type]
        finally:
            os.close(ns)
    finally:
        os.close(root)
