"""The warm launcher's wire protocol: one ``marshal``-encoded dict per SOCK_SEQPACKET datagram, with
fds as SCM_RIGHTS. ``marshal`` and ``_socket`` cost nothing to import (json and socket.py pull in re
and enum, ~15 ms per ``agentcell run`` here). Both ends are the same uid, outside any cell and with the same
powers (checked as they connect, :mod:`.peer`), so the payload is trusted; it is still
type-checked where it is used. The warm launcher's own ops (a cell host's are in :mod:`.server`, and the
launcher forks one for ``run`` and ``open``)::

  client -> {"op": "spawn", "id": N, "spec": {...}, "argv": [...]}   + fds [stdin, stdout, stderr]
  client -> {"op": "signal", "id": N, "sig": 15} | {"op": "status"} | {"op": "stop"}
  server -> {"id": N, "event": "going" | "started" | "exit" | "error", ...} | {"event": "status", ...}

``going`` comes just before the command is let go: a client that loses the launcher after it reports the
command lost, never runs it again (cold, or through another launcher).
"""
from __future__ import annotations

import _socket
import marshal

from ..cell.handoff import pack_fds, unpack_fds
from ..cell.spec import TYPE_CHECKING
from ..errors import AgentcellError

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, Protocol

    class Sock(Protocol):
        def sendmsg(self, buffers: Sequence[bytes], ancdata: Sequence[tuple[int, int, bytes]]) -> int: ...
        def recvmsg(self, bufsize: int, ancbufsize: int) -> tuple[bytes, list[tuple[int, int, bytes]], int, Any]: ...
        def recvmsg_into(self, buffers: Sequence[bytearray],
                         ancbufsize: int) -> tuple[int, list[tuple[int, int, bytes]], int, Any]: ...
        def getsockopt(self, level: int, option: int, buflen: int) -> bytes: ...

MAX_FDS = 4  # (the front's cli: its working directory and stdio)
MAX_MESSAGE = 1 << 20  # a bigger argv goes the cold way


class WireError(Exception):
    pass


def send(sock: Sock, obj: dict[str, object], fds: list[int] | None = None) -> None:
    anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pack_fds(fds))] if fds else []
    data = marshal.dumps(obj)
    if len(data) > MAX_MESSAGE:
        raise WireError(f"request of {len(data)} bytes is larger than {MAX_MESSAGE}")
    sock.sendmsg([data], anc)


def buffer() -> bytearray:
    """A buffer for :func:`recv` to read into, for a loop that reads many messages: a fresh one of
    MAX_MESSAGE bytes for each is mapped, faulted in, shrunk and unmapped again (with a TLB shootdown
    on every other CPU running a thread of the process), ~15 us per message here."""
    return bytearray(MAX_MESSAGE)


def recv(sock: Sock, max_fds: int = MAX_FDS, buf: bytearray | None = None) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds that came with it (at most ``max_fds``); (None, []) when the peer has gone.
    ``buf`` (:func:`buffer`, one thread's own) is read into instead of a buffer made for this message."""
    data: bytes | memoryview
    if buf is None:
        data, anc, _flags, _addr = sock.recvmsg(MAX_MESSAGE, _socket.CMSG_SPACE(max_fds * 4))
    else:
        n, anc, _flags, _addr = sock.recvmsg_into([buf], _socket.CMSG_SPACE(max_fds * 4))
        data = memoryview(buf)[:n]
    fds = unpack_fds(anc)
    if not data:
        return None, fds
    msg = marshal.loads(data)
    if not isinstance(msg, dict):
        raise WireError("malformed message")
    return msg, fds


def recv_or_gone(sock: Sock, buf: bytearray | None = None) -> tuple[dict[str, Any] | None, list[int]]:
    """:func:`recv`, where a read that fails or a message that is not one counts as the peer gone:
    (None, [])."""
    try:
        return recv(sock, buf=buf)
    except (OSError, WireError, ValueError, EOFError, TypeError):
        return None, []


def error_from(msg: dict[str, Any]) -> AgentcellError:
    """The host's ``{"event": "error", "field", "message", "code"}`` as the error it reports."""
    field = str(msg.get("field") or "")
    err = AgentcellError(field, str(msg.get("message") or "").removeprefix(f"{field}: "))
    err.exit_code = int(msg.get("code") or 125)
    return err


def ready(objs: list[Any], timeout: float | None) -> list[Any]:
    """Those of ``objs`` (fds, or objects with fileno()) that are readable within ``timeout``: poll,
    not select, which cannot take an fd above 1023."""
    return poll(objs, [], timeout)[0]


def poll(readers: list[Any], writers: list[Any], timeout: float | None) -> tuple[list[Any], list[Any]]:
    """(those of ``readers`` that are readable or have gone, those of ``writers`` that can be written to or
    have gone) within ``timeout``."""
    import select

    poller = select.poll()
    by_fd: dict[int, Any] = {}
    masks: dict[int, int] = {}
    for objs, mask in ((readers, select.POLLIN), (writers, select.POLLOUT)):
        for o in objs:
            fd = o if isinstance(o, int) else o.fileno()
            by_fd[fd] = o
            masks[fd] = masks.get(fd, 0) | mask
    for fd, mask in masks.items():
        poller.register(fd, mask)
    events = poller.poll(None if timeout is None else timeout * 1000)
    gone = select.POLLHUP | select.POLLERR | select.POLLNVAL
    readable = [by_fd[fd] for fd, ev in events if masks[fd] & select.POLLIN and ev & (select.POLLIN | gone)]
    writable = [by_fd[fd] for fd, ev in events if masks[fd] & select.POLLOUT and ev & (select.POLLOUT | gone)]
    return readable, writable
