"""The warm launcher: a single-threaded process that forks cells on request.

A long-lived, multi-threaded program must never fork (a lock held by another thread stays locked in
the child), so :class:`agentcell.Cell` starts this process once with ``subprocess`` (fork+exec is safe)
and asks it, over a private SOCK_SEQPACKET socketpair, to launch cells. stdio fds travel with each
request (SCM_RIGHTS). Every launch is a fresh cell: nothing is reused between commands.

Protocol (one JSON object per datagram):
  -> {"op": "spawn", "id": N, "spec": {...}, "argv": [...]}   + fds [stdin, stdout, stderr]
  -> {"op": "signal", "id": N, "sig": 15}
  <- {"id": N, "event": "started"} | {"id": N, "event": "exit", "result": {...}}
     | {"id": N, "event": "error", "field": ..., "message": ...}
"""
from __future__ import annotations

import array
import json
import os
import select
import socket
import sys

from ..errors import AgentcellError
from . import launch
from .spec import spec_from_dict

MAX_FDS = 3
BUFSIZE = 1 << 20


def recv(sock: socket.socket) -> tuple[dict[str, object] | None, list[int]]:
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(BUFSIZE, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, typ, data in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return (json.loads(msg) if msg else None), list(fds)


def send(sock: socket.socket, obj: dict[str, object], fds: list[int] | None = None) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([json.dumps(obj).encode()], anc)


def serve(sock: socket.socket) -> None:
    cells: dict[int, launch.Running] = {}  # keyed by request id
    while True:
        readers: list[object] = [sock, *cells.values()]
        ready, _, _ = select.select(readers, [], [])
        for r in ready:
            if r is sock:
                msg, fds = recv(sock)
                if msg is None:
                    for c in cells.values():
                        c.kill()
                        c.wait()
                    return
                _handle(sock, msg, fds, cells)
            else:
                _progress(sock, r, cells)  # type: ignore[arg-type]


def _handle(sock: socket.socket, msg: dict[str, object], fds: list[int], cells: dict[int, launch.Running]) -> None:
    rid = int(msg["id"])  # type: ignore[call-overload]
    if msg["op"] == "signal":
        if rid in cells:
            cells[rid].forward(int(msg["sig"]))  # type: ignore[call-overload]
        return
    try:
        spec = spec_from_dict(msg["spec"])  # type: ignore[arg-type]
        cells[rid] = launch.start(spec, [str(a) for a in msg["argv"]], stdio=fds)  # type: ignore[attr-defined]
        send(sock, {"id": rid, "event": "started"})
    except AgentcellError as e:
        send(sock, {"id": rid, "event": "error", "field": e.field, "message": e.line(), "code": e.exit_code})
    finally:
        for fd in fds:
            os.close(fd)


def _progress(sock: socket.socket, running: launch.Running, cells: dict[int, launch.Running]) -> None:
    running.poll_messages(0)
    if running.finished_reading():
        rid = next(k for k, v in cells.items() if v is running)
        del cells[rid]
        send(sock, {"id": rid, "event": "exit", "result": running.wait().as_dict()})


def main() -> None:
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    serve(sock)


if __name__ == "__main__":
    main()
