"""What the netlink readers share (the audit stream, the proc connector, the firewall's log)."""
from __future__ import annotations

import socket

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def set_rcvbuf(sock: socket.socket, size: int) -> None:
    """A receive buffer of ``size``: past net.core.rmem_max when we may (root), else as large as allowed.
    Kernel queues that fill on a busy host overflow less (an overflow is telemetry, and work to redo)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
