"""What the failed-call source reads each call against: the cell's own view (:class:`View`, its mount
tree as the launcher built it from the spec and the protected entries) and what exists on the host
(:class:`Host`), which the classifier (:mod:`.attempts`) asks by name."""
from __future__ import annotations

import os
import pwd
import stat
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..cell.spec import CACHE_PATH, SCRATCH_PATH, SECRET_DIRS, SECRET_FILES, CellSpec


class View:
    """The cell's mount tree by area: ``system``, ``ro``, ``rw``, ``guarded`` (a protected entry,
    read-only; ``pinned``: one that may not be renamed), ``mask``, ``home``, ``private`` (its own /tmp,
    /dev/shm, /scratch), ``dev``, ``proc``; anything else is ``hidden`` (not in the cell)."""

    def __init__(self, spec: CellSpec, guarded: Sequence[tuple[str, bool]], hidden: Sequence[str]) -> None:
        self.areas: dict[str, str] = {"/proc": "proc", "/dev": "dev", "/dev/pts": "dev", "/dev/shm": "private",
                                      "/tmp": "private", SCRATCH_PATH: "private"}
        if spec.cache_dir:
            self.areas[CACHE_PATH] = "private"
        self.links: dict[str, str] = {}  # top-level symlinks of the system (/bin -> /usr/bin)
        for p in spec.system_paths:
            if os.path.islink(p):
                self.links[p] = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
            elif os.path.isdir(p):
                self.areas[p] = "system"
        self.home = spec.identity.home.rstrip("/") or "/"
        self.areas[self.home] = "home"
        self.areas.update({p: "rw" for p in spec.rw_paths})
        self.areas.update({p: "ro" for p in spec.ro_paths if self.areas.get(p) != "system"})
        self.areas.update({p: "mask" for p in spec.masked_paths})
        self.declared_masks = set(spec.masked_paths)
        self.areas.update({p: "guarded" if ro else "pinned" for p, ro in guarded})
        for p in (*SECRET_FILES, *SECRET_DIRS, *hidden):
            if self.area(p)[0] not in ("hidden", "private", "home"):
                self.areas[p] = "mask"
        # Directories that lead to what the cell contains (/home, /home/you for /home/you/project): the
        # cell has them, empty but for that way down; tools look for their config in each.
        self.ancestors = {d for p in self.areas for d in _parents(p)} - {"/"}
        self.uid, self.network = spec.identity.uid, spec.network

    def resolve_links(self, path: str) -> str:
        for link, target in self.links.items():
            if path == link or path.startswith(link + "/"):
                return target + path[len(link):]
        return path

    def area(self, path: str) -> tuple[str, str]:
        """(area, the mount it lies in) of an absolute, normalised path."""
        p = path
        while True:
            kind = self.areas.get(p)
            if kind is not None:
                return kind, p
            if p == "/":
                return "hidden", "/"
            p = os.path.dirname(p)


def _parents(path: str) -> list[str]:
    out = []
    while path != "/":
        path = os.path.dirname(path)
        out.append(path)
    return out


class Host:
    """What the host has, as the classifier asks (a test replaces it). Lookups are of names only."""

    def __init__(self, pid1: int = 0) -> None:
        self.pid1 = pid1
        self.root_fd: int | None = None  # the cell's root, held by the monitor with its mount namespace
        self._homes: set[str] | None = None
        self._cache: dict[str, tuple[float, Any]] = {}

    def exists(self, path: str) -> bool:
        try:
            os.lstat(path)
            return True
        except (OSError, ValueError):
            return False

    def homes(self) -> set[str]:
        """The home directories of the host's accounts, and /root."""
        if self._homes is None:
            out = {"/root"}
            for pw in pwd.getpwall():
                home = os.path.normpath(pw.pw_dir or "/")
                if home.count("/") >= 2 and not home.startswith(("/usr/", "/var/", "/run/", "/dev/", "/proc/",
                                                                  "/bin", "/sbin", "/nonexistent")):
                    out.add(home)
            self._homes = out
        return self._homes

    def _root(self) -> str:
        """Where the cell's tree is walked from: its root as the monitor holds it (with its mount
        namespace: the tree outlives the cell's last process), else PID 1's root while it lives."""
        if self.root_fd is not None:
            return f"/proc/self/fd/{self.root_fd}"
        return f"/proc/{self.pid1}/root" if self.pid1 else ""

    def exists_in_cell(self, path: str) -> bool:
        """Whether ``path`` (no link in it) exists in the cell's view now."""
        root = self._root()
        try:
            os.lstat(f"{root}{path}")
            return bool(root)
        except (OSError, ValueError):
            return False

    def is_socket(self, path: str) -> bool:
        try:
            return stat.S_ISSOCK(os.lstat(path).st_mode)
        except (OSError, ValueError):
            return False

    def pid_exists(self, pid: int) -> bool:
        return os.path.exists(f"/proc/{pid}")

    def is_device(self, path: str) -> bool:
        try:
            return stat.S_ISCHR(os.lstat(path).st_mode) or stat.S_ISBLK(os.lstat(path).st_mode)
        except (OSError, ValueError):
            return False

    def _table(self, name: str, read: Callable[[], Any]) -> Any:
        now = time.monotonic()
        hit = self._cache.get(name)
        if hit is None or now - hit[0] > 1.0:
            hit = (now, read())
            self._cache[name] = hit
        return hit[1]

    def listens(self, port: int, *, cell: bool = False) -> bool:
        """Whether something listens on TCP ``port`` in the host's network namespace (``cell``: the
        cell's own, through its PID 1)."""
        where = f"/proc/{self.pid1}/net" if cell else "/proc/self/net"

        def read() -> set[int]:
            out = set()
            for name in ("tcp", "tcp6"):
                try:
                    with open(f"{where}/{name}") as f:
                        for line in f.readlines()[1:]:
                            fields = line.split()
                            if len(fields) > 3 and fields[3] == "0A":
                                out.add(int(fields[1].rsplit(":", 1)[1], 16))
                except OSError:
                    pass
            return out
        return port in self._table(where, read)

    def abstract(self, name: str) -> bool:
        """Whether an abstract unix socket ``name`` exists in the host's network namespace."""
        def read() -> set[str]:
            try:
                with open("/proc/self/net/unix", errors="surrogateescape") as f:  # (names are any bytes)
                    return {ln.split()[-1][1:] for ln in f.readlines()[1:] if len(ln.split()) >= 8
                            and ln.split()[-1].startswith("@")}
            except OSError:
                return set()
        return name in self._table("abstract", read)

    def cwd(self, pid: int, tid: int = 0) -> str | None:
        """The working directory of task ``tid`` (of process ``pid``): by the thread's own entry first,
        which still reads when its process's leader has ended (a zombie's cwd does not)."""
        for task in (tid, pid) if tid and tid != pid else (pid,):
            try:
                return os.readlink(f"/proc/{task}/cwd")
            except OSError:
                continue
        return None

    def fd_path(self, pid: int, fd: int, tid: int = 0) -> str | None:
        for task in (tid, pid) if tid and tid != pid else (pid,):
            try:
                path = os.readlink(f"/proc/{task}/fd/{fd}")
            except OSError:
                continue
            return path if path.startswith("/") else None
        return None

    def resolve(self, path: str, pid: int = 0, tid: int = 0, owned: Callable[[int], bool] | None = None) -> str | None:
        """``path`` (absolute) as the kernel walks it in the cell for task ``tid`` of process ``pid``: each
        symlink followed where it stands (an absolute one from the cell's root), ``..`` taken after it, at
        most 40 links; past the first name that is not there, the rest as written. The caller's own magic
        links (``/proc/self``, ``/proc/thread-self``: their root, cwd and fds) are followed from the host's
        side: they do not read for the monitor, which has no number in the cell's namespace. ``/proc/N/root``
        of a task of the cell's is the cell's root (no task of a cell can chroot): read, the link says so
        too, but not once the task is exiting (a zombie's does not read), nor once it is gone (the monitor
        reads after the fact: under load, after the cell's last process), when ``owned(N)`` says whether N
        was a task of the cell's at the call. None if the cell's tree cannot be reached (not held, and PID 1
        gone)."""
        root = self._root()
        if not root or not os.path.isdir(root + "/"):
            return None
        todo = [p for p in path.split("/") if p]
        at, links = "/", 0
        while todo:
            part = todo.pop(0)
            if part == ".":
                continue
            if part == "..":
                at = os.path.dirname(at)
                continue
            if at == "/proc" and part in ("self", "thread-self") and pid and todo:
                base = self._own(todo, pid, tid if part == "thread-self" else 0)
                if base is None:  # (another entry of its own, or one that cannot be read now)
                    return os.path.normpath(os.path.join("/proc", part, *todo))
                at = "/"
                todo[:0] = [p for p in base.split("/") if p]
                links += 1
                continue
            here = os.path.join(at, part)
            task_root = at == "/proc" and part.isascii() and part.isdigit() and todo[:1] == ["root"]
            try:
                st = os.lstat(root + here)
            except (OSError, ValueError):
                if task_root and owned is not None and owned(int(part)):
                    todo.pop(0)
                    at = "/"
                    links += 1
                    continue
                return os.path.normpath(os.path.join(here, *todo))  # not there: nothing further is walked
            if task_root:  # a task of the cell's now; its root link does not read once it is exiting
                todo.pop(0)
                at = "/"
                links += 1
                continue
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > 40:
                    return os.path.normpath(os.path.join(here, *todo))
                try:
                    target = os.readlink(root + here)
                except OSError:
                    return os.path.normpath(os.path.join(here, *todo))
                if target.startswith("/"):
                    at = "/"
                todo[:0] = [p for p in target.split("/") if p]
                continue
            at = here
            if todo and not stat.S_ISDIR(st.st_mode):
                return os.path.normpath(os.path.join(here, *todo))
        return at

    def _own(self, todo: list[str], pid: int, tid: int) -> str | None:
        """Where the caller's ``/proc/self/root``, ``cwd`` or ``fd/N`` (``todo``, taken from it) leads: the
        cell's root (a cell cannot chroot), its working directory, the file of that fd."""
        what = todo[0]
        if what == "root":
            todo.pop(0)
            return "/"
        if what == "cwd":
            todo.pop(0)
            return self.cwd(pid, tid)
        if what == "fd" and len(todo) > 1 and todo[1].isascii() and todo[1].isdigit():
            fd = int(todo[1])
            del todo[:2]
            return self.fd_path(pid, fd, tid)
        return None

    def resolvers(self) -> set[str]:
        """The host's DNS servers (/etc/resolv.conf): a query to one of them is what libc does by itself."""
        def read() -> set[str]:
            try:
                with open("/etc/resolv.conf", errors="replace") as f:
                    return {ln.split()[1] for ln in f if ln.startswith("nameserver") and len(ln.split()) > 1}
            except OSError:
                return set()
        return set(self._table("resolvers", read))
