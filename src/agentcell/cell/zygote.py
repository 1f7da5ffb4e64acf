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
from .spec import CellSpec, spec_from_dict

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


class _Warm:
    """At most one prepared cell, for the spec of the last request (a Cell has one policy)."""

    def __init__(self) -> None:
        self.cell: launch.Prepared | None = None
        self.wanted: CellSpec | None = None

    def take(self, spec: CellSpec) -> launch.Prepared:
        cell, self.cell = self.cell, None
        if cell is not None and cell.spec == spec:
            return cell
        if cell is not None:
            cell.discard()
        return launch.prepare(spec.replace(cell_id=""))  # every cell gets its own id

    def refill(self, spec: CellSpec) -> None:
        try:
            self.cell = launch.prepare(spec.replace(cell_id=""))
        except AgentcellError:
            self.cell = None  # the next request prepares (and reports) it in the foreground

    def drop(self) -> None:
        if self.cell is not None:
            self.cell.discard()
            self.cell = None


def serve(sock: socket.socket, prewarm: bool) -> None:
    cells: dict[int, launch.Running] = {}  # keyed by request id
    warm = _Warm()
    try:
        while True:
            readers: list[socket.socket | launch.Running] = [sock, *cells.values()]
            ready, _, _ = select.select(readers, [], [])
            for r in ready:
                if isinstance(r, launch.Running):
                    _progress(sock, r, cells)
                    continue
                msg, fds = recv(sock)
                if msg is None:
                    for c in cells.values():
                        c.kill()
                        c.wait()
                    return
                spec = _handle(sock, msg, fds, cells, warm)
                if spec is not None and prewarm:
                    warm.wanted = spec
            # Prepare the next cell when idle: agents' tool calls come seconds apart, and preparing
            # while a command runs would compete with it for the CPU.
            if not cells and warm.wanted is not None and warm.cell is None:
                warm.refill(warm.wanted)
    finally:
        warm.drop()


def _handle(sock: socket.socket, msg: dict[str, object], fds: list[int], cells: dict[int, launch.Running],
            warm: _Warm) -> CellSpec | None:
    rid = int(msg["id"])  # type: ignore[call-overload]
    if msg["op"] == "signal":
        if rid in cells:
            cells[rid].signal(int(msg["sig"]))  # type: ignore[call-overload]
        return None
    try:
        spec = spec_from_dict(msg["spec"])  # type: ignore[arg-type]
        cells[rid] = warm.take(spec).go([str(a) for a in msg["argv"]], stdio=fds)  # type: ignore[attr-defined]
        send(sock, {"id": rid, "event": "started"})
        return spec
    except AgentcellError as e:
        send(sock, {"id": rid, "event": "error", "field": e.field, "message": e.line(), "code": e.exit_code})
        return None
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
    sock = socket.socket(fileno=int(sys.argv[1]))
    serve(sock, prewarm=sys.argv[2:] != ["--no-prewarm"])


if __name__ == "__main__":
    main()
