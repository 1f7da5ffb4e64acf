"""Hand the command to a prepared cell: argv and fds over a private socketpair (SCM_RIGHTS).

A cell is prepared (namespaces, mounts, pivot_root) before it knows its command; PID 1 then waits
here. The cold path (``agentcell run``) hands the command over at once, the warm launcher ahead of
time, so both run the same code. Uses ``_socket`` directly: ``socket.py`` imports enum (~6 ms here).
"""
from __future__ import annotations

import _socket
import os
import struct

from ..errors import LaunchError

_HEADER = struct.Struct("!IB")  # payload length, bitmask of the fds (0-2) to put on the cell's pty
MAX_FDS = 64


def pack_fds(fds: list[int]) -> bytes:
    """SCM_RIGHTS payload (struct, not array: array imports collections.abc, ~3 ms per run here)."""
    return struct.pack(f"{len(fds)}i", *fds)


def unpack_fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, blob in anc:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            n = len(blob) // 4
            fds.extend(struct.unpack(f"{n}i", blob[: n * 4]))
    return fds


_LIVE = 0x80  # in the header's bitmask: no command, serve many (cell/execd.py)


class Command:
    """argv; ``fds``: the number the command sees -> the received fd; ``tty_fds``: numbers that get
    the cell's own pty instead (an interactive run); ``live``: no argv, the cell serves commands."""

    def __init__(self, argv: list[str], fds: dict[int, int], tty_fds: tuple[int, ...], live: bool = False) -> None:
        self.argv, self.fds, self.tty_fds, self.live = argv, fds, tty_fds, live


def channel() -> tuple[_socket.socket, _socket.socket]:
    a, b = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    return a, b


def send(sock: _socket.socket, argv: list[str], fds: dict[int, int], tty_fds: tuple[int, ...] = (),
         live: bool = False) -> None:
    """Send the command; ``fds`` maps the fd number the command will see to the sender's fd."""
    if len(fds) > MAX_FDS:
        raise LaunchError("command", f"too many fds to pass ({len(fds)} > {MAX_FDS})")
    targets = list(fds)
    payload = b"\0".join([",".join(map(str, targets)).encode(), *(os.fsencode(a) for a in argv)])
    data = _HEADER.pack(len(payload), sum(1 << fd for fd in tty_fds if 0 <= fd < 3) | (_LIVE if live else 0)) + payload
    anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pack_fds([fds[t] for t in targets]))] if fds else []
    sent = sock.sendmsg([data], anc)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv(sock: _socket.socket) -> Command | None:
    """Receive the command; None if the preparing side went away without one (discarded). Reads
    exactly its bytes: a live cell's requests follow on the same channel."""
    data, anc, _flags, _addr = sock.recvmsg(_HEADER.size, _socket.CMSG_SPACE(MAX_FDS * 4))
    if not data:
        return None
    received = unpack_fds(anc)
    while len(data) < _HEADER.size:
        data += _recv_more(sock, _HEADER.size - len(data))
    length, ttys = _HEADER.unpack_from(data)
    while len(data) < _HEADER.size + length:
        data += _recv_more(sock, _HEADER.size + length - len(data))
    head, *args = data[_HEADER.size:_HEADER.size + length].split(b"\0")
    targets = [int(t) for t in head.decode().split(",") if t]
    if len(targets) != len(received):
        raise LaunchError("command", "fds were lost on the way into the cell")
    tty_fds = tuple(fd for fd in range(3) if ttys & (1 << fd))
    argv = [os.fsdecode(a) for a in args if a or not ttys & _LIVE]
    return Command(argv, dict(zip(targets, received, strict=True)), tty_fds, bool(ttys & _LIVE))


def send_fd(sock: _socket.socket, fd: int, tag: bytes = b"P") -> None:
    """An fd from the cell to the supervisor: the master of an interactive command's pty (P), the
    proxy's listening socket made in the cell's network namespace (L)."""
    send_fds(sock, [fd], tag)


def send_fds(sock: _socket.socket, fds: list[int], tag: bytes) -> None:
    """Several fds in one message (the cell's root and its mount namespace: R)."""
    sock.sendmsg([tag], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pack_fds(fds))])


def recv_fd(sock: _socket.socket, tag: bytes = b"P") -> int | None:
    """That fd, or None if the cell failed before it made one."""
    fds = recv_fds(sock, tag, 1)
    return fds[0] if fds is not None else None


def recv_fds(sock: _socket.socket, tag: bytes, count: int) -> list[int] | None:
    """The ``count`` fds of one message, or None if the cell failed before it sent them (its status pipe
    says why). A message that came without them (this process out of fds: the kernel drops what does
    not fit) is a failed launch, never a cell that runs on without what they are for (a monitor's
    listener, a canary's watch)."""
    data, anc, flags, _addr = sock.recvmsg(1, _socket.CMSG_SPACE(4 * count))
    fds = unpack_fds(anc)
    if not data:
        return None
    if data != tag or len(fds) != count or flags & _socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise LaunchError("hand-off", f"the cell's {tag.decode(errors='replace')!r} came without its "
                          f"{count} fd(s) (got {len(fds)}): this process may be out of file descriptors",
                          "raise its open-file limit (ulimit -n) and run again")
    return fds


def _recv_more(sock: _socket.socket, most: int) -> bytes:
    chunk = sock.recv(min(most, 1 << 20))
    if not chunk:
        raise LaunchError("command", "the command was cut short on its way into the cell")
    return chunk
