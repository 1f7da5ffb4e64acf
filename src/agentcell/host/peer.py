"""Who is at the other end of a connection: a launcher, a cell host and their clients serve and trust
only a peer that is them in all but its pid.

What a server does for a client it does with its own powers, and a client hands a server its
environment, stdio and command: so both ends refuse a peer that

* is another uid, or sits in another user, PID, mount, network, UTS, IPC, cgroup or time namespace (a
  rootless cell has our uid; a process in a network namespace of its own must not reach the host's
  network through us);
* is in another cgroup (its limits and its device and egress filters would not hold for what we run),
  or another audit login or session (the audit trail would name the wrong person);
* may do less: fewer supplementary groups or capabilities (any set), no_new_privs where we have none,
  a seccomp filter where we have none (or another count of them), a lower hard resource limit.

It is read from /proc through the peer's pidfd (``SO_PEERPIDFD``, Linux 6.5; before, ``pidfd_open`` of
``SO_PEERCRED``'s pid), checked alive after the read: the process that connected, never a later one
given its number. Known limits: two seccomp filter stacks of the same count are not told apart; a
Landlock domain is not visible in /proc; a process that passes its connection to another lends it
its powers. The compiled front (front/agentcell.c) makes the same checks of its launcher.
"""
from __future__ import annotations

import _socket
import os
import struct

from ..cell.spec import TYPE_CHECKING

if TYPE_CHECKING:
    import signal
    from typing import Any
else:  # (signal.py imports enum; see cell/launch.py)
    import _signal as signal

SO_PEERCRED = 17
SO_PEERPIDFD = 77
NAMESPACES = ("user", "pid", "mnt", "net", "uts", "ipc", "cgroup", "time")
CAPS = ("CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:")
SAME = ("cgroup", "loginuid", "sessionid")  # /proc/PID files that must read the same


def accept_ours(listener: Any) -> Any:
    """The next connection on ``listener`` if its peer is ours (:func:`refusal`), else None (closed)."""
    fd, _addr = listener._accept()
    conn = _socket.socket(fileno=fd)
    if refusal(conn):
        conn.close()
        return None
    return conn


def peer_is_ours(sock: Any) -> bool:
    return not refusal(sock)


def listen_here(listener: Any, backlog: int) -> None:
    """listen() again in this process, so that the socket's credentials (what a client's SO_PEERCRED
    reads) are this server's, not those of the process that bound it and has exited since."""
    listener.listen(backlog)


def peer_cred(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, the pid as seen from our PID namespace."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, SO_PEERCRED, 12))
    return int(pid), int(uid), int(gid)


def refusal(sock: Any) -> str:
    """Why the peer is not ours ('' if it is)."""
    pid, uid, _gid = peer_cred(sock)
    if uid != os.geteuid():
        return f"uid {uid}"
    try:
        pidfd = sock.getsockopt(_socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return "gone"
    try:
        pid = _pid_of(pidfd)
        why = _differs(str(pid))
        signal.pidfd_send_signal(pidfd, 0)  # still that process: what was read is its own
    except (OSError, ValueError):
        return "gone"
    finally:
        os.close(pidfd)
    return why


def _differs(pid: str) -> str:
    for ns in NAMESPACES:
        try:
            ours = os.stat(f"/proc/self/ns/{ns}")
        except OSError:
            continue  # (a kernel without it)
        theirs = os.stat(f"/proc/{pid}/ns/{ns}")
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
            return f"another {ns} namespace"
    for name in SAME:
        if _read(pid, name) != _read("self", name):
            return f"another {name}"
    theirs_p, ours_p = _powers(pid), _powers("self")
    for key in ("Uid:", "Gid:"):
        if theirs_p[key] != ours_p[key]:
            return f"other {key[:-1].lower()}s"
    if not set(ours_p["Groups:"].split()) <= set(theirs_p["Groups:"].split()):
        return "fewer supplementary groups"
    for key in CAPS:
        if int(ours_p[key], 16) & ~int(theirs_p[key], 16):
            return f"fewer capabilities ({key[:-1]})"
    if theirs_p["NoNewPrivs:"] > ours_p["NoNewPrivs:"]:
        return "no_new_privs"
    if theirs_p["Seccomp:"] != "0" and (theirs_p["Seccomp:"], theirs_p.get("Seccomp_filters:")) != (
            ours_p["Seccomp:"], ours_p.get("Seccomp_filters:")):
        return "a seccomp filter of its own"
    for name, limit in ours_p["limits"].items():
        if theirs_p["limits"].get(name, 0) < limit:
            return f"a lower hard limit: {name}"
    return ""


def _read(pid: str, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return f.read()
    except FileNotFoundError:
        return ""  # (a kernel without audit has no loginuid)


def _pid_of(pidfd: int) -> int:
    """The pid a pidfd refers to in our PID namespace (its fdinfo's ``Pid:``)."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:") and int(line.split()[1]) > 0:
                return int(line.split()[1])
    raise ValueError("exited")


def _powers(pid: str) -> dict[str, Any]:
    """A process's credentials, capability sets, no_new_privs and seccomp state (/proc/PID/status),
    and its hard resource limits (/proc/PID/limits; unlimited as the largest number)."""
    out: dict[str, Any] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition("\t")
            out[key] = value.strip()
    limits = {}
    with open(f"/proc/{pid}/limits") as f:
        for line in list(f)[1:]:
            name, hard = line[:26].strip(), line[47:68].strip()
            limits[name] = 1 << 64 if hard == "unlimited" else int(hard)
    out["limits"] = limits
    return out
