"""Exec watch: the proc connector (NETLINK_CONNECTOR, CN_IDX_PROC) reports every exec and uid change
on the host within a millisecond; the monitor keeps those of the cell's processes that matter.

* an exec of a tool whose only use in a cell is to get more privilege or to leave: sudo, su, pkexec,
  passwd, newgrp, sg, ssh, mount, umount, chsh, chfn, gpasswd (the cell's mounts are nosuid, so
  they cannot work: trying is the signal);
* any uid change of a cell's process (nothing in a cell can change its uid by design).

The event carries only pids: the executable is read from ``/proc/<pid>/exe`` (and ``comm``) at once;
a process that is already gone is reported by pid alone. Needs CAP_NET_ADMIN in the host's network
namespace (root).
"""
from __future__ import annotations

import os
import socket
import struct
from typing import Any

NETLINK_CONNECTOR = 11
CN_IDX_PROC, CN_VAL_PROC = 1, 1
PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE = 1, 2
PROC_EVENT_EXEC, PROC_EVENT_UID = 0x2, 0x4
PRIVILEGE_TOOLS = frozenset({"sudo", "su", "pkexec", "passwd", "newgrp", "sg", "ssh", "mount", "umount", "chsh",
                             "chfn", "gpasswd", "doas"})
_NLMSG = struct.Struct("=IHHII")
_CNMSG = struct.Struct("=IIIIHH")
_EVENT = struct.Struct("=IIQ")


class ExecWatch:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_CONNECTOR)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            self.sock.bind((0, CN_IDX_PROC))
            self._control(PROC_CN_MCAST_LISTEN)
        except BaseException:
            self.sock.close()
            raise

    def _control(self, op: int) -> None:
        body = _CNMSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, 4, 0) + struct.pack("=I", op)
        self.sock.send(_NLMSG.pack(_NLMSG.size + len(body), 3, 0, 0, os.getpid()) + body)  # NLMSG_DONE

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[dict[str, Any]]:
        """exec and uid events now readable: {"kind": "exec"|"uid", "pid": …, ...}; never blocks."""
        out: list[dict[str, Any]] = []
        self.sock.setblocking(False)
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return out
            except OSError:  # ENOBUFS: events were dropped
                out.append({"kind": "lost"})
                continue
            off = _NLMSG.size + _CNMSG.size
            if len(data) < off + _EVENT.size:
                continue
            what, _cpu, _ts = _EVENT.unpack_from(data, off)
            body = off + _EVENT.size
            if what == PROC_EVENT_EXEC and len(data) >= body + 8:
                pid, _tgid = struct.unpack_from("=ii", data, body)
                out.append({"kind": "exec", "pid": pid, **_identify(pid)})
            elif what == PROC_EVENT_UID and len(data) >= body + 16:
                pid, _tgid, ruid, euid = struct.unpack_from("=iiII", data, body)
                out.append({"kind": "uid", "pid": pid, "ruid": ruid, "euid": euid, **_identify(pid)})

    def close(self) -> None:
        try:
            self._control(PROC_CN_MCAST_IGNORE)
        except OSError:
            pass
        self.sock.close()


def _identify(pid: int) -> dict[str, str]:
    """What the process is, read at once (it may be gone: then empty strings)."""
    out = {"exe": "", "comm": "", "cgroup": ""}
    for key, path in (("exe", f"/proc/{pid}/exe"), ("comm", f"/proc/{pid}/comm"), ("cgroup", f"/proc/{pid}/cgroup")):
        try:
            if key == "exe":
                out[key] = os.readlink(path)
            else:
                with open(path) as f:
                    out[key] = f.read().strip()
        except OSError:
            pass
    return out
