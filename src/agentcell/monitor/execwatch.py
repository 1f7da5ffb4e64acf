"""Exec watch: the proc connector (NETLINK_CONNECTOR, CN_IDX_PROC) reports every exec and uid change
on the host within a millisecond; the monitor keeps those of the cell's processes that matter.

* an exec of a tool whose only use in a cell is to get more privilege or to leave: sudo, su, pkexec,
  passwd, newgrp, sg, mount, umount, chsh, chfn, gpasswd, doas (the cell's mounts are nosuid, so
  they cannot work: trying is the signal);
* any uid change of a cell's process (nothing in a cell can change its uid by design).

The connector's events carry only pids, so two things make the watch exact rather than racy:

* **membership by descent**: fork and exit events are followed from the cell's PID 1, so a process
  is known to be the cell's even if it is gone before anyone looks at ``/proc`` (a cgroup read races
  with a short-lived process);
* **which binary, from the kernel**: :class:`ToolExecs` puts fanotify ``FAN_OPEN_EXEC`` marks on the
  privilege tools' binaries themselves (notification only: nothing on the host ever waits for us);
  each event holds the binary open, so its name is known even when ``mount --version`` has long
  exited. Where fanotify is unavailable the connector's exec event and ``/proc/<pid>/exe`` remain.

Needs CAP_NET_ADMIN in the host's network namespace and CAP_SYS_ADMIN (root).
"""
from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from ..hostfs import read_proc
from ..netlink import set_rcvbuf
from .source import close_later

NETLINK_CONNECTOR = 11
CN_IDX_PROC, CN_VAL_PROC = 1, 1
PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE = 1, 2
PROC_EVENT_FORK, PROC_EVENT_EXEC, PROC_EVENT_UID, PROC_EVENT_EXIT = 0x1, 0x2, 0x4, 0x80000000
TOOL_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin", "/usr/local/sbin")
# Not ssh: git runs it for every push over ssh, and it gains nothing in a cell (no setuid bit on a
# nosuid mount, no way out but the proxy, no key but one the user gives).
PRIVILEGE_TOOLS = frozenset({"sudo", "su", "pkexec", "passwd", "newgrp", "sg", "mount", "umount", "chsh", "chfn",
                             "gpasswd", "doas"})
_NLMSG = struct.Struct("=IHHII")
_CNMSG = struct.Struct("=IIIIHH")
_EVENT = struct.Struct("=IIQ")


def filters_events() -> bool:
    """Whether this kernel's proc connector filters events per listener (Linux 6.6: struct proc_input)."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 6)


def connector_problem() -> str:
    """Empty if this process may join the proc connector's group (``agentcell doctor``: joined and left at
    once, nothing asked for), else why not."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_CONNECTOR) as sk:
            sk.bind((0, CN_IDX_PROC))
    except OSError as e:
        return str(e.strerror)
    return ""


class ExecWatch:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_CONNECTOR)
        try:
            # The whole host's forks, execs and exits arrive here; twenty busy sessions on two cores
            # starve a monitor for a while now and then: 16 MiB overflowed about one full test run in
            # five (memory is taken only while messages wait).
            set_rcvbuf(self.sock, 32 << 20)
            self.sock.bind((0, CN_IDX_PROC))
            self._control(PROC_CN_MCAST_LISTEN)
            self.on_read: Callable[[], None] | None = None  # called for each message read (the watchdog's)
        except BaseException:
            self.sock.close()
            raise

    def _control(self, op: int) -> None:
        """Listen (or stop). From Linux 6.6 a listener names the events it wants: only forks, execs,
        uid changes and exits, so a cell renaming itself in a loop (PR_SET_NAME, a COMM event each, a
        microsecond apiece) or calling setsid cannot fill this socket's buffer with events nobody
        reads. Older kernels take the bare operation (and send everything)."""
        data = struct.pack("=I", op)
        if op == PROC_CN_MCAST_LISTEN and filters_events():
            data += struct.pack("=I", PROC_EVENT_FORK | PROC_EVENT_EXEC | PROC_EVENT_UID | PROC_EVENT_EXIT)
        body = _CNMSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(data), 0) + data
        self.sock.send(_NLMSG.pack(_NLMSG.size + len(body), 3, 0, 0, os.getpid()) + body)  # NLMSG_DONE

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self, limit: int = 8192) -> list[dict[str, Any]]:
        """fork, exit, exec and uid events now readable (at most ``limit``: the caller's loop must come
        round): {"kind": "fork"|"exit"|"exec"|"uid", "pid": …, ...}; never blocks. Threads are not
        events here (their processes are)."""
        out: list[dict[str, Any]] = []
        for _ in range(limit):
            if self.on_read is not None:
                self.on_read()
            try:
                data = self.sock.recv(4096, socket.MSG_DONTWAIT)  # (not setblocking: a call more per pass)
            except BlockingIOError:
                return out
            except OSError as e:
                if e.errno != errno.ENOBUFS:  # a closed or broken socket: the source has stopped
                    raise
                out.append({"kind": "lost"})  # events were dropped
                continue
            off = _NLMSG.size + _CNMSG.size
            if len(data) < off + _EVENT.size:
                continue
            what, _cpu, _ts = _EVENT.unpack_from(data, off)
            body = off + _EVENT.size
            if what == PROC_EVENT_FORK and len(data) >= body + 16:
                _ppid, ptgid, cpid, ctgid = struct.unpack_from("=iiii", data, body)
                if cpid == ctgid:  # a new process
                    out.append({"kind": "fork", "parent": ptgid, "pid": ctgid})
            elif what == PROC_EVENT_EXIT and len(data) >= body + 12:
                pid, tgid, status = struct.unpack_from("=iiI", data, body)
                if pid == tgid:
                    out.append({"kind": "exit", "pid": tgid, "status": status})  # a wait status
            elif what == PROC_EVENT_EXEC and len(data) >= body + 8:
                pid, _tgid = struct.unpack_from("=ii", data, body)
                out.append({"kind": "exec", "pid": pid})  # identified by the monitor, for its cell's only
            elif what == PROC_EVENT_UID and len(data) >= body + 16:
                pid, _tgid, ruid, euid = struct.unpack_from("=iiII", data, body)
                out.append({"kind": "uid", "pid": pid, "ruid": ruid, "euid": euid})
        return out

    def close(self) -> None:
        try:
            self._control(PROC_CN_MCAST_IGNORE)
        except OSError:
            pass
        self.sock.close()


def identify(pid: int) -> dict[str, str]:
    """What the process is, read at once (it may be gone: then empty strings): its file, and the name
    it gave itself only where its file cannot be read (that name is only ever a stand-in for it)."""
    out = {"exe": "", "comm": ""}
    try:
        out["exe"] = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        try:  # (a process names itself: any bytes)
            out["comm"] = read_proc(f"/proc/{pid}/comm").decode(errors="replace").strip()
        except OSError:
            pass
    return out


class ToolExecs:
    """fanotify FAN_OPEN_EXEC on the privilege tools' binaries (by inode: every name and bind of them)."""

    def __init__(self) -> None:
        from ..cell import fanotify

        self.fd = fanotify.init(fanotify.FAN_CLASS_NOTIF)
        seen: set[tuple[int, int]] = set()
        try:
            for d in TOOL_DIRS:
                for name in PRIVILEGE_TOOLS:
                    path = os.path.join(d, name)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        fanotify.mark(self.fd, fanotify.FAN_OPEN_EXEC, path)
        except BaseException:
            os.close(self.fd)
            raise

    def fileno(self) -> int:
        return self.fd

    def read(self) -> list[dict[str, Any]]:
        """{"pid", "tool"} for each exec of a marked binary since the last read ({"kind": "lost"} on overflow)."""
        from ..cell import fanotify

        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        out: list[dict[str, Any]] = []
        for mask, fd, pid in fanotify.events(data):
            if mask & fanotify.FAN_Q_OVERFLOW:
                out.append({"kind": "lost", "tools": True})
            if fd < 0:
                continue
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = "?"
            finally:
                os.close(fd)
            out.append({"kind": "tool", "pid": pid, "tool": os.path.basename(path), "exe": path})
        return out

    def close(self) -> None:
        os.close(self.fd)


class ExecMarks:
    """Execs from the cell's own mounts (:mod:`agentcell.cell.execmarks`, the group PID 1 marked them
    with): a :class:`agentcell.monitor.source.Source` of notes for binaries with privilege of their own
    that ran powerless; ``named(pid, path)`` hears every exec's file (the monitor's table of processes:
    a process that exits at once is still named)."""

    name = "execmarks"

    def __init__(self, fd: int, pid1: int, cell: str, named: Callable[[int, str], None],
                 marked: tuple[str, ...] = ()) -> None:
        self.fd, self.pid1, self.cell, self.named, self.marked = fd, pid1, cell, named, marked
        self._mounts: dict[str, str] = {}
        self._read_mounts()  # now, while PID 1 lives (the cell's mounts do not change: it may not mount)

    def _read_mounts(self) -> None:
        try:
            with open(f"/proc/{self.pid1}/mountinfo", errors="surrogateescape") as f:  # (names are bytes)
                self._mounts = {ln.split()[0]: _unescape(ln.split()[4]) for ln in f if len(ln.split()) > 4}
        except OSError:
            pass

    def fileno(self) -> int:
        return self.fd

    def _where(self, fd: int) -> str:
        """The executed file's path in the cell: its path in its mount, below that mount's point (a marked
        host directory, bound at its own path, where that very file is; else the cell's mount table)."""
        rel = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
        for point in self.marked:
            try:
                there = os.lstat(point + rel)
            except (OSError, ValueError):
                continue
            if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino):
                return os.path.normpath(point + rel)
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                mnt = next((ln.split()[1] for ln in f if ln.startswith("mnt_id:")), "")
            if mnt not in self._mounts:
                self._read_mounts()
            point = self._mounts.get(mnt, "")
        except OSError:
            point = ""
        # Shown relative to the mount's root, or already whole (a bind of a host directory at its own path)
        if not point or point == "/" or rel == point or rel.startswith(point + "/"):
            return rel
        return os.path.normpath(point + "/" + rel)

    def read(self) -> list[Any]:
        from ..cell import fanotify
        from .event import CellEvent

        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        out = []
        for mask, fd, pid in fanotify.events(data):
            if mask & fanotify.FAN_Q_OVERFLOW:
                out.append(CellEvent("telemetry", "exec", "the kernel dropped exec events of the cell's own mounts",
                                     source="telemetry", cell=self.cell, acts=False))
            if fd < 0:
                continue
            try:
                path = self._where(fd)
                self.named(pid, path)
                if _privileged(fd):
                    out.append(CellEvent("execute", path, "a binary with privilege of its own (setuid, setgid or "
                                         "file capabilities) ran without it: the cell's mounts are nosuid and its "
                                         "processes have no_new_privs", source="exec", cell=self.cell, pid=pid,
                                         exe=path, acts=False))
            except OSError:
                pass
            finally:
                os.close(fd)
        return out

    def close(self) -> None:
        close_later(self.fd)


def _unescape(field: str) -> str:
    """A mountinfo field, its octal escapes (\\040 for a space) undone."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _privileged(fd: int) -> bool:
    """Setuid, setgid, or file capabilities."""
    import stat

    if os.fstat(fd).st_mode & (stat.S_ISUID | stat.S_ISGID):
        return True
    try:
        return bool(os.getxattr(fd, "security.capability"))
    except OSError:
        return False
