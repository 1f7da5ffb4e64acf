"""The client of a live cell's host (:mod:`.server`, op ``open``): one connection, a reader thread that
hands each command's messages to its waiter, the monitor's events, the cell's end. Started by
:class:`.remote.RemoteHost` (``open``, ``open_named``) or connected to a named cell (``agentcell cell``).

A private cell's client also gets a **lane**: a channel of its own to the cell's exec server
(:mod:`..cell.execd`), on which it sends its commands itself and reads their ends, so that a command does
not go through the host's relay and back (two wake-ups of one process by another, and the relay's work:
about a sixth of a monitored ``true``). What the host does for a command it relays, the client does for
one on its lane: the cell's environment and working directory (the host sends them with the lane), the
words for one that never started. A command with a ``timeout``, or a request the host must refuse, goes
through the host, which keeps its deadline or words the refusal. The cell's end still comes from the host
(``ended``, with its reason): what the lane said before it is taken first."""
from __future__ import annotations

import _socket
import errno
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..cell import execd
from ..cell.spec import CellSpec, spec_to_dict
from ..errors import AgentcellError, LaunchError
from . import wire

if TYPE_CHECKING:
    import subprocess


class RemoteLive:
    """The client of a live cell's host (:mod:`.server`): one connection, a reader thread that hands each
    command's messages to its waiter, the monitor's events, the cell's end. Thread-safe."""

    def __init__(self, sock: _socket.socket, proc: subprocess.Popen[bytes] | None, cell_id: str, pid1: int,
                 lane: _Lane | None = None) -> None:
        import queue
        import threading

        self._sock, self._proc, self.cell_id, self.pid1 = sock, proc, cell_id, pid1
        self._lane = lane
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

        wire.send(sock, {"op": "open", "spec": spec_to_dict(spec), "monitor": monitor, "give_to": human(),
                         "lane": True})
        msg, fds = wire.recv(sock)
        lane = _Lane(fds[0], msg) if msg is not None and msg.get("event") == "opened" and len(fds) == 1 else None
        if lane is None:
            for fd in fds:
                os.close(fd)
        if msg is None:
            raise LaunchError("cell", "the cell's host ended before the cell started")
        if msg.get("event") == "error":
            raise wire.error_from(msg)
        return cls(sock, proc, str(msg["cell_id"]), int(msg["pid1"]), lane)

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
        import select

        buf = wire.buffer()
        lane = self._lane
        waits = select.poll()
        host = self._sock.fileno()
        waits.register(host, select.POLLIN)
        if lane is not None:
            waits.register(lane.fd, select.POLLIN)
        try:
            self._read(buf, lane, waits, host)
        finally:
            if lane is not None:  # (the lane's fd is closed here, by the one thread that reads it, between sends)
                with lane.lock:
                    lane.sock.close()

    def _read(self, buf: bytearray, lane: _Lane | None, waits: Any, host: int) -> None:
        while True:
            if lane is not None and lane.open and all(fd != host for fd, _ in waits.poll()):
                self._deliver(lane.reports())  # (the host's messages, when it has one, first)
                if not lane.open:
                    waits.unregister(lane.fd)
                continue
            msg, fds = wire.recv_or_gone(self._sock, buf)
            for fd in fds:
                os.close(fd)
            if lane is not None and lane.open and (msg is None or msg.get("event") == "ended"):
                self._deliver(lane.reports(drain=True))  # (what it said before the end: the cell is down)
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

    def _deliver(self, reports: list[dict[str, Any]]) -> None:
        for msg in reports:
            one = self._pending.get(msg["id"])
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
            on_lane = self._lane is not None and timeout is None and self._lane.sent(cid, argv, fds, env, cwd)
        except BaseException:
            self.forget(cid)
            raise
        if on_lane:
            if self._done.is_set():  # (the cell had ended: this one may have come after its end was said)
                self.forget(cid)
                raise CellEnded(self.ended or "the cell has ended")
            return cid, waiting
        try:
            wire.send(self._sock, {"op": "exec", "id": cid, "argv": argv, "env": env, "cwd": cwd,
                                   "timeout": timeout}, list(fds))
        except (OSError, wire.WireError) as e:
            self.forget(cid)
            if isinstance(e, wire.WireError) or e.errno == errno.EMSGSIZE:  # (larger than one datagram here)
                raise AgentcellError("exec", "the command's argv and environment are more than one request to a "
                                     "live cell takes", "pass large data through stdin or a file") from None
            if e.errno not in GONE and self.ended is None:  # (the host is there: the request could not go)
                raise AgentcellError("exec", f"the request could not be sent to the cell's host: {e.strerror or e}",
                                     "see the error; ETOOMANYREFS: this account has too many fds in flight") \
                    from None
            raise CellEnded(self.ended or "the cell's host has gone") from None
        except BaseException:
            self.forget(cid)
            raise
        return cid, waiting

    def signal(self, cid: int, sig: int) -> None:
        from ..errors import CellEnded

        if self._lane is not None and self._lane.signal(cid, int(sig)):
            return
        try:
            wire.send(self._sock, {"op": "signal", "id": cid, "sig": int(sig)})
        except OSError:
            raise CellEnded(self.ended or "the cell's host has gone") from None

    def forget(self, cid: int) -> None:
        with self._lock:
            self._pending.pop(cid, None)
        if self._lane is not None:
            self._lane.forget(cid)

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
        if self._lane is not None:
            self._lane.shut()

    def close(self, timeout: float | None = 30.0) -> dict[str, Any] | None:
        self.terminate("closed")
        self._done.wait(timeout)
        try:
            self._sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._lane is not None:
            self._lane.shut()
        if self._proc is not None:
            import subprocess

            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:  # our own child: its cell dies with it
                self._proc.kill()
                self._proc.wait()
        return self.result


GONE = (errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENOTCONN)  # a send failed: the peer has gone
LANE_MAX = 64 << 10  # a larger request goes through the host: what a live cell takes does not depend on the way


class _Lane:
    """The client's channel to its cell's exec server (see the module's doc). Its requests are sent whole,
    by one thread at a time, waiting while the server does not take them (one it never takes again is
    stopped, which the host sees: it ends the cell, and the send fails); its reports are read by the
    reader thread alone."""

    def __init__(self, fd: int, opened: dict[str, Any]) -> None:
        import threading
        import time

        os.set_inheritable(fd, False)  # (as the host's connection: a child of the client's must not read it)
        self.sock = _socket.socket(fileno=fd)
        self.sock.setblocking(True)
        self.fd = fd
        self.env: dict[bytes, bytes] = dict(opened["env"])
        self.cwd = str(opened["cwd"])
        self.open = True
        self._now = time.monotonic
        self.lock = threading.Lock()
        self._buf = b""
        self._ours: dict[int, tuple[str, str, float]] = {}  # id -> (its name, its working directory, its start)

    def sent(self, cid: int, argv: list[str], fds: Sequence[int], env: dict[str, str], cwd: str | None) -> bool:
        """Whether ``argv`` went on the lane (else the host takes it: one it refuses, the host words).
        Once sent, its end comes from the lane, or from the cell's (its send failed: the server is gone)."""
        if not self.open or len(fds) != 3 or execd.malformed(argv, env, cwd):
            return False
        where = cwd or self.cwd
        try:
            data = execd.request(execd.exec_request(cid, argv, {**self.env, **execd.encoded(env)} if env else self.env,
                                                    where, (0, 1, 2)), list(fds))
        except ValueError:
            return False
        if len(data) > LANE_MAX:
            return False  # (the host takes what one of its requests takes, and says what it does not)
        self._ours[cid] = (argv[0], where, self._now())
        if not self._send(data, list(fds)):
            self._ours.pop(cid, None)
            return False
        return True

    def signal(self, cid: int, sig: int) -> bool:
        if cid not in self._ours or not 0 < sig <= execd.MAX_SIG:
            return False  # (the host's: it says what is wrong with it)
        return self._send(execd.request({"op": "signal", "id": cid, "sig": sig}, []), [])

    def forget(self, cid: int) -> None:
        self._ours.pop(cid, None)

    def shut(self) -> None:
        """No more requests, nor reports: the reader thread sees its end (and closes the fd)."""
        try:
            self.sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass

    def _send(self, data: bytes, fds: list[int]) -> bool:
        """Whether the request went, or the server is gone (then the cell's end, coming, ends its command:
        137, why); False when the kernel refused it with the server there (ETOOMANYREFS: the account's fds
        in flight; ENOBUFS, ENOMEM) before any of it went: the host takes it instead. Anything else that
        stops a send (part of it sent and then an error; an exception from a signal's handler, after which
        how much went cannot be known) leaves the lane out of step: it is shut, which ends the server and
        the cell, rather than have the server read what comes next as the rest of this request, or the
        command run by the host as well."""
        from ..cell.handoff import pack_fds

        view = memoryview(data)
        anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pack_fds(fds))] if fds else []
        sent = 0
        with self.lock:
            try:
                sent = self.sock.sendmsg([view], anc, _socket.MSG_NOSIGNAL)
                while sent < len(view):
                    sent += self.sock.send(view[sent:], _socket.MSG_NOSIGNAL)
            except OSError as e:
                if e.errno is None:  # (not the kernel's: a signal's handler raised it)
                    self.shut()
                    raise
                if sent == 0 and e.errno not in GONE:
                    return False
                self.shut()
            except BaseException:
                self.shut()
                raise
        return True

    def reports(self, drain: bool = False) -> list[dict[str, Any]]:
        """The ends the server has reported, as the host words them (``drain``: all it said, to its end)."""
        out: list[dict[str, Any]] = []
        while self.open:
            try:
                chunk = self.sock.recv(1 << 16, _socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.open = False
                break
            got, self._buf = execd.parse_reports(self._buf + chunk)
            for kind, cid, a, b in got:
                mine = self._ours.get(cid)
                if mine is not None:
                    name, cwd, started = mine
                    out.append(execd.end_message(cid, kind, a, b, started, name, cwd))
            if not drain:
                break
        return out
