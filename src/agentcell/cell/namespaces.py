"""Namespaces: one unshare for mount, PID, IPC, UTS and network (plus user in rootless mode)."""
from __future__ import annotations

import fcntl
import os
import struct

from ..errors import LaunchError
from . import syscalls as sc
from .spec import CellSpec

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def flags_for(spec: CellSpec) -> int:
    f = sc.CLONE_NEWNS | sc.CLONE_NEWPID | sc.CLONE_NEWIPC | sc.CLONE_NEWUTS
    if spec.network != "host-firewall":  # that mode keeps the host's network, filtered on the uid
        f |= sc.CLONE_NEWNET
    if spec.identity.userns:
        f |= sc.CLONE_NEWUSER
    return f


def enter(spec: CellSpec, outer_uid: int, outer_gid: int) -> None:
    """Unshare every namespace the cell needs; in rootless mode map our own uid/gid 1:1.

    The user namespace is created first by the kernel (same call), so it owns the others and the
    child keeps full capabilities inside it until it execs the command as a non-zero uid.
    """
    try:
        sc.unshare(flags_for(spec))
    except PermissionError:
        if not spec.identity.userns:
            raise
        raise LaunchError("namespaces", "this kernel refuses unprivileged user namespaces (needed to run as yourself)",
                          "'agentcell doctor' shows why and how to allow them, or run through sudo with --as") from None
    if spec.identity.userns:
        map_ids(spec.identity.uid, spec.identity.gid, outer_uid, outer_gid)


def map_ids(uid: int, gid: int, outer_uid: int, outer_gid: int) -> None:
    """Map exactly one uid and gid into our new user namespace. gid_map may only be written by an
    unprivileged process after setgroups is denied."""
    for path, data in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {outer_uid} 1\n"),
                       ("/proc/self/gid_map", f"{gid} {outer_gid} 1\n")):
        with open(path, "w") as f:
            f.write(data)


def loopback_up() -> None:
    """Bring ``lo`` up in the cell's network namespace (an ioctl; no netlink library, no socket module)."""
    s = sc.inet_dgram_socket()
    try:
        ifr = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))
    finally:
        os.close(s)


def set_hostname(name: str) -> None:
    sc.sethostname(name)


def proxy_listener(ctl: object) -> None:
    """A TCP listener on 127.0.0.1:PROXY_PORT in this (the cell's) network namespace, sent over the
    hand-off channel to the supervisor, which has it served by the proxy; we keep no copy."""
    import _socket

    from . import handoff
    from .spec import PROXY_PORT

    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        s.bind(("127.0.0.1", PROXY_PORT))
        s.listen(128)
        handoff.send_fd(ctl, s.fileno(), b"L")  # type: ignore[arg-type]
    finally:
        s.close()
