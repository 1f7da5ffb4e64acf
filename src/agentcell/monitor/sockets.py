"""Which process holds a TCP or UDP socket: its local port in a network namespace's socket tables
(``/proc/<pid>/net/tcp``, …: the namespace of that pid), then the socket's inode among the fds of the
cell's processes. How a refusal by the proxy (it knows the client's port in the cell) or by the host
firewall (the packet's source port) is pinned on a process. Read at once: a socket closes with its
process."""
from __future__ import annotations

import os
from collections.abc import Iterable


def owner(netns_pid: int | str, proto: str, local_port: int, remote_port: int | None,
          pids: Iterable[int]) -> int | None:
    """The first of ``pids`` holding a ``proto`` ("tcp" or "udp") socket bound to ``local_port`` (and,
    given, connected to ``remote_port``) in the network namespace of ``netns_pid`` ("self": ours)."""
    if not local_port:
        return None
    inodes: set[str] = set()
    for name in (proto, proto + "6"):
        try:
            with open(f"/proc/{netns_pid}/net/{name}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            lport = int(fields[1].rsplit(":", 1)[1], 16)
            rport = int(fields[2].rsplit(":", 1)[1], 16)
            if lport == local_port and (remote_port is None or rport == remote_port) and fields[9] != "0":
                inodes.add(fields[9])
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return pid
            except OSError:
                continue
    return None
