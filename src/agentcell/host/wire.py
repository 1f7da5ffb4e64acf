"""The warm launcher's wire protocol: one ``marshal``-encoded dict per SOCK_SEQPACKET datagram, with
fds as SCM_RIGHTS. ``marshal`` and ``_socket`` cost nothing to import (json and socket.py pull in re
and enum, ~15 ms per ``agentcell run`` here). Both ends are the same uid and outside any cell (checked
with SO_PEERCRED and the peer's namespaces, :func:`peer_is_ours`), so the payload is trusted; it is still
type-checked where it is used. The warm launcher's own ops (a cell host's are in :mod:`.server`, and the
launcher forks one for ``run`` and ``open``)::

  client -> {"op": "spawn", "id": N, "spec": {...}, "argv": [...]}   + fds [stdin, stdout, stderr]
  client -> {"op": "signal", "id": N, "sig": 15} | {"op": "status"} | {"op": "stop"}
  server -> {"id": N, "event": "started" | "exit" | "error", ...} | {"event": "status", ...}
"""
from __future__ import annotations

import _socket
import marshal
import os
import struct

from ..cell.handoff import pack_fds, unpack_fds
from ..cell.spec import TYPE_CHECKING
from ..errors import AgentcellError

if TYPE_CHECKING:
    import signal
    from collections.abc import Sequence
    from typing import Any, Protocol

    class Sock(Protocol):
        def sendmsg(self, buffers: Sequence[bytes], ancdata: Sequence[tuple[int, int, bytes]]) -> int: ...
        def recvmsg(self, bufsize: int, ancbufsize: int) -> tuple[bytes, list[tuple[int, int, bytes]], int, Any]: ...
        def getsockopt(self, level: int, option: int, buflen: int) -> bytes: ...
else:  # (signal.py imports enum; see cell/launch.py)
    import _signal as signal

MAX_FDS = 4  # (the front's cli: its working directory and stdio)
MAX_MESSAGE = 1 << 20  # a bigger argv goes the cold way
SO_PEERCRED = 17


class WireError(Exception):
    pass


def send(sock: Sock, obj: dict[str, object], fds: list[int] | None = None) -> None:
    anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pack_fds(fds))] if fds else []
    data = marshal.dumps(obj)
    if len(data) > MAX_MESSAGE:
        raise WireError(f"request of {len(data)} bytes is larger than {MAX_MESSAGE}")
    sock.sendmsg([data], anc)


def recv(sock: Sock) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds that came with it; (None, []) when the peer has gone."""
    data, anc, _flags, _addr = sock.recvmsg(MAX_MESSAGE, _socket.CMSG_SPACE(MAX_FDS * 4))
    fds = unpack_fds(anc)
    if not data:
        return None, fds
    msg = marshal.loads(data)
    if not isinstance(msg, dict):
        raise WireError("malformed message")
    return msg, fds


def recv_or_gone(sock: Sock) -> tuple[dict[str, Any] | None, list[int]]:
    """:func:`recv`, where a read that fails or a message that is not one counts as the peer gone:
    (None, [])."""
    try:
        return recv(sock)
    except (OSError, WireError, ValueError, EOFError, TypeError):
        return None, []


def accept_ours(listener: Any) -> Any:
    """The next connection on ``listener``, if its peer is our own uid and not inside a cell (our
    user, PID and mount namespaces) and may do all we may (:func:`peer_may_what_we_may`), else None
    (it is closed). Only our own uid: same privileges, nothing to gain; never from inside a cell: a
    rootless cell has our uid and could otherwise ask for a cell with a wider policy."""
    fd, _addr = listener._accept()
    conn = _socket.socket(fileno=fd)
    if not peer_is_ours(conn) or peer_may_what_we_may(conn):
        conn.close()
        return None
    return conn


SO_PEERPIDFD = 77  # Linux >= 6.5: the process that connected, as a pidfd
CAPS = ("CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:")


def peer_may_what_we_may(conn: Any) -> str:
    """Why the peer may do less than this server ('' if it may do all it may): what a server does
    for a client it does with its own powers, so a client with fewer (a root shell that dropped
    capabilities or a supplementary group, no_new_privs, a seccomp filter this server lacks, lower
    hard resource limits) is refused, and runs what it asked for itself. Read through the peer's pidfd
    (the process that connected, never a later one given its number); a kernel without SO_PEERPIDFD
    (before 6.5) is refused too."""
    try:
        pidfd = conn.getsockopt(_socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        return "this kernel cannot name a peer's process (SO_PEERPIDFD: Linux 6.5)"
    try:
        theirs = _powers(_pid_of(pidfd))
        signal.pidfd_send_signal(pidfd, 0)  # still that process: what was read is its own
    except (OSError, ValueError):
        return "the peer has gone"
    finally:
        os.close(pidfd)
    ours = _our_powers()
    for key in ("Uid:", "Gid:"):
        if theirs[key] != ours[key]:
            return f"its {key[:-1].lower()}s differ"
    if not set(ours["Groups:"].split()) <= set(theirs["Groups:"].split()):
        return "it lacks a supplementary group of ours"
    for key in CAPS:
        if int(ours[key], 16) & ~int(theirs[key], 16):
            return f"it lacks capabilities of ours ({key[:-1]})"
    if theirs["NoNewPrivs:"] > ours["NoNewPrivs:"]:
        return "it runs with no_new_privs"
    if theirs["Seccomp:"] != "0" and (theirs["Seccomp:"], theirs.get("Seccomp_filters:")) != (
            ours["Seccomp:"], ours.get("Seccomp_filters:")):
        return "it runs under a seccomp filter of its own"
    for name, limit in ours["limits"].items():
        if theirs["limits"].get(name, 0) < limit:
            return f"its hard limit {name!r} is lower"
    return ""


_OURS: list[dict[str, Any]] = []


def _our_powers() -> dict[str, Any]:
    """Ours, read once: a server never changes its credentials or limits."""
    if not _OURS:
        _OURS.append(_powers("self"))
    return _OURS[0]


def _pid_of(pidfd: int) -> int:
    """The pid a pidfd refers to in our PID namespace (its fdinfo's ``Pid:``)."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:") and int(line.split()[1]) > 0:
                return int(line.split()[1])
    raise ValueError("exited")


def _powers(pid: int | str) -> dict[str, Any]:
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


def peer_is_ours(sock: Sock) -> bool:
    """The other end is our own uid and not inside a cell (our user, PID and mount namespaces); both
    ways: a server must take no orders from a cell, and a client must hand no command, stdio or
    environment to a "launcher" a rootless cell (our uid) set up where ours would listen. A server's
    credentials are those of its listen() call: servers call :func:`listen_here` at their start."""
    pid, uid, _gid = peer_cred(sock)
    return uid == os.geteuid() and shares_our_namespaces(pid)


def listen_here(listener: Any, backlog: int) -> None:
    """listen() again in this process, so that the socket's credentials (what a client's SO_PEERCRED
    reads) are this server's, not those of the process that bound it and has exited since."""
    listener.listen(backlog)


def peer_cred(sock: Sock) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, the pid as seen from our PID namespace."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, SO_PEERCRED, 12))
    return int(pid), int(uid), int(gid)


def shares_our_namespaces(pid: int) -> bool:
    """Is ``pid`` in our user, PID and mount namespaces? A cell never is, even when its uid is ours
    (rootless): a launcher must not take orders from inside a cell that can reach its socket."""
    try:
        for ns in ("user", "pid", "mnt"):
            theirs, ours = os.stat(f"/proc/{pid}/ns/{ns}"), os.stat(f"/proc/self/ns/{ns}")
            if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
                return False
    except OSError:
        return False  # gone, or not ours to inspect: refuse
    return True


def error_from(msg: dict[str, Any]) -> AgentcellError:
    """The host's ``{"event": "error", "field", "message", "code"}`` as the error it reports."""
    field = str(msg.get("field") or "")
    err = AgentcellError(field, str(msg.get("message") or "").removeprefix(f"{field}: "))
    err.exit_code = int(msg.get("code") or 125)
    return err
