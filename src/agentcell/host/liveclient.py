"""The client of a live cell's host (:mod:`.server`, op ``open``): one connection, a reader thread that
hands each command's messages to its waiter, the monitor's events, the cell's end. Started by
:class:`.remote.RemoteHost` (``open``, ``open_named``) or connected to a named cell (``agentcell cell``)."""
from __future__ import annotations

import _socket
import errno
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..cell.spec import CellSpec, spec_to_dict
from ..errors import AgentcellError, LaunchError
from . import wire

if TYPE_CHECKING:
    import subprocess


class RemoteLive:
    """The client of a live cell's host (:mod:`.server`): one connection, a reader thread that hands each
    command's messages to its waiter, the monitor's events, the cell's end. Thread-safe."""

    def __init__(self, sock: _socket.socket, proc: subprocess.Popen[bytes] | None, cell_id: str, pid1: int) -> None:
        import queue
        import threading

        self._sock, self._proc, self.cell_id, self.pid1 = sock, proc, cell_id, pid1
        self._queue = queue.SimpleQueue  # (a Queue's get and put cost ~8 µs more per command)
        self._lock = threading.Lock()
        self._pending: dict[int, Any] = {}
        self._next = 0
        self._events: list[dict[str, Any]] = []
        self.ended: str | None = None
        self.result: dict[str, Any] | None = None
        self._done = threading.Event()
        threading.Thread(target=self._reader, name="agentcell-live-reader", daemon=True).start()

    @classmethod
    def handshake(cls, sock: _socket.socket, proc: subprocess.Popen[bytes] | None, spec: CellSpec,
                  monitor: str | None) -> RemoteLive:
        """Open the cell on a connection to its host (a fresh one, or a named cell's listener)."""
        from ..protect.check import human

        wire.send(sock, {"op": "open", "spec": spec_to_dict(spec), "monitor": monitor, "give_to": human()})
        msg, _ = wire.recv(sock)
        if msg is None:
            raise LaunchError("cell", "the cell's host ended before the cell started")
        if msg.get("event") == "error":
            raise wire.error_from(msg)
        return cls(sock, proc, str(msg["cell_id"]), int(msg["pid1"]))

    @classmethod
    def connect(cls, sock: _socket.socket) -> RemoteLive:
        """A client of a named cell's host (``agentcell cell``), already open."""
        from ..errors import CellEnded

        wire.send(sock, {"op": "status"})
        msg, _ = wire.recv(sock)
        if msg is None or msg.get("event") != "status":
            raise CellEnded("the cell's host did not answer")
        if msg.get("ended"):
            raise CellEnded(str(msg["ended"]))
        return cls(sock, None, str(msg["cell_id"]), int(msg["pid1"]))

    def _reader(self) -> None:
        buf = wire.buffer()
        while True:
            msg, fds = wire.recv_or_gone(self._sock, buf)
            for fd in fds:
                os.close(fd)
            if msg is None or msg.get("event") == "ended":
                if msg is not None:
                    self.result = msg.get("result")
                self.ended = str(msg["reason"]) if msg is not None else self.ended or "the cell's host died"
                with self._lock:
                    waiting = list(self._pending.values())
                for q in waiting:
                    q.put({"event": "lost"})
                self._done.set()
                if msg is None:
                    return
                continue
            if msg.get("event") in ("escape", "note"):
                self._events.append(msg["data"])
                continue
            cid = msg.get("id")
            if msg.get("event") == "exit" and msg.get("ended") and self.ended is None:
                # The cell's end cut this command short: said before the command's own end is delivered,
                # for whoever looks at the cell once its command has returned.
                self.ended = str(msg["ended"])
            one = self._pending.get(cid) if isinstance(cid, int) else None
            if one is not None:
                one.put(msg)

    def events(self) -> list[dict[str, Any]]:
        return list(self._events)

    def exec(self, argv: list[str], fds: Sequence[int], *, env: dict[str, str], cwd: str | None,
             timeout: float | None) -> tuple[int, Any]:
        """Start ``argv`` on ``fds`` (stdin, stdout, stderr); (its id, the queue its messages come to:
        ``exit``, ``error``, or ``lost`` once the cell has ended)."""
        from ..errors import CellEnded

        with self._lock:
            self._next += 1
            cid = self._next
            waiting = self._pending[cid] = self._queue()
        try:
            wire.send(self._sock, {"op": "exec", "id": cid, "argv": argv, "env": env, "cwd": cwd,
                                   "timeout": timeout}, list(fds))
        except (OSError, wire.WireError) as e:
            self.forget(cid)
            if isinstance(e, wire.WireError) or e.errno == errno.EMSGSIZE:  # (larger than one datagram here)
                raise AgentcellError("exec", "the command's argv and environment are more than one request to a "
                                     "live cell takes", "pass large data through stdin or a file") from None
            raise CellEnded(self.ended or "the cell's host has gone") from None
        except BaseException:
            self.forget(cid)
            raise
        return cid, waiting

    def signal(self, cid: int, sig: int) -> None:
        from ..errors import CellEnded

        try:
            wire.send(self._sock, {"op": "signal", "id": cid, "sig": int(sig)})
        except OSError:
            raise CellEnded(self.ended or "the cell's host has gone") from None

    def forget(self, cid: int) -> None:
        with self._lock:
            self._pending.pop(cid, None)

    def poll(self) -> dict[str, Any] | None:
        return self.result if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        self._done.wait(timeout)
        return self.result

    def terminate(self, reason: str) -> None:
        """End the cell (commands still running are killed); its host reports ``stopped (asked to stop)``."""
        if self.ended is None:
            try:
                wire.send(self._sock, {"op": "stop"})
            except OSError:
                pass

    def release(self) -> None:
        """Let go of a named cell's connection; the cell stays (``agentcell cell start`` is done)."""
        self._sock.close()

    def close(self, timeout: float | None = 30.0) -> dict[str, Any] | None:
        self.terminate("closed")
        self._done.wait(timeout)
        try:
            self._sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._proc is not None:
            import subprocess

            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:  # our own child: its cell dies with it
                self._proc.kill()
                self._proc.wait()
        return self.result
