"""The cell host: a fresh process that runs one supervised cell (:class:`agentcell.supervise.Supervised`:
its monitor, proxy and host-firewall table), either a live cell (``Supervised.start(live=True)``) whose
clients' commands it serves, or one command in a cell of its own on its stdio: the session's harness.

A process of its own because its callers are threaded (a Python program, an MCP server's event loop,
LangChain): the launcher must never fork from a threaded process, and this one forks the cell while
its only thread runs (the monitor's thread starts after). Started by fork+exec, like the warm
launcher (:func:`agentcell.host.interp.isolated`).

Two ways in: ``--conn FD``, one private client (:meth:`agentcell.Cell.open`): its EOF stops the cell;
``--listen FD --path SOCKET --name NAME --idle S`` (``agentcell cell start``): clients of our own uid,
never from inside a cell, come and go; the cell stays until ``stop`` or ``--idle`` seconds without a
command. The protocol is the warm launcher's (:mod:`agentcell.host.wire`: one marshal dict per
SOCK_SEQPACKET datagram, stdio as SCM_RIGHTS)::

  client -> {"op": "open", "spec": {...}, "monitor": VERDICT | None, "give_to": [UID, GID] | None}
                                                           (first, once: a live cell)
  client -> {"op": "run", "spec": {...}, "argv": [...], "monitor": ..., "dedicated": B, "guard": B}
                                                           (instead: one command, --conn only)
  client -> {"op": "exec", "id": N, "argv": [...], "env": {...}, "cwd": DIR | None, "timeout": S | None}
            + fds [stdin, stdout, stderr]
  client -> {"op": "signal", "id": N, "sig": S} | {"op": "status"} | {"op": "stop"}
  host   -> {"event": "opened", "cell_id", "pid1"} | {"event": "error", "field", "message", "code"}
  host   -> {"id": N, "event": "exit", "exit_status", "signal", "timed_out", "duration_s", "ended": REASON | None,
             "not_started": LINE (only for one that never started: 127, 126, and why, for its caller to say)}
  host   -> {"event": "escape" | "note", "data": {...}}   (to every client, as the monitor sees it)
  host   -> {"event": "ended", "reason": REASON, "result": {...}}   (to every client, last)

An escape (under ``terminate``) ends the cell: every command still running gets its ``exit`` with
the reason in ``ended``, and every client the ``ended`` message. For ``run`` the host answers
``{"event": "going", "cell_id"}`` just before the command may run (a client that loses the host after
it must not run the command again), ``{"event": "started", "cell_id", "pid1"}``, the monitor's events,
``{"event": "stats", "stats"}`` about once a second and ``ended`` last; the client may send
``{"op": "terminate", "reason"}``, and its EOF terminates the cell.
"""
from __future__ import annotations

import _socket
import collections
import errno
import marshal
import math
import os
import threading
import time
from typing import Any

from .. import hostfs
from ..cell.execd import KILL, MAX_SIG, encoded, end_message, malformed
from ..cell.spec import spec_from_dict
from ..errors import AgentcellError, Terminated
from . import peer, wire

GRACE_S = 3.0  # a command asked to die (timeout), or the cell asked to stop, has this long; then the cell is killed
LOOK_S = 0.25  # how often the exec server's state is looked at while it has work
MAX_CLIENTS = 64
MAX_BACKLOG = 16 << 20  # bytes waiting for one client that does not read; past them it is dropped, as gone
LINGER_S = 300.0  # an ended named cell answers "ended: REASON" this long
SERVER_GONE = (errno.EPIPE, errno.ECONNRESET, errno.EBADF)  # a send to the exec server failed: it is gone


class _Exec:
    def __init__(self, conn: _socket.socket, cid: int, deadline: float | None, name: str = "", cwd: str = "") -> None:
        self.conn, self.cid, self.deadline = conn, cid, deadline
        self.name, self.cwd = name, cwd  # (to word why it never started, if it does not)
        self.started = time.monotonic()
        self.timed_out = False
        self.killed_at: float | None = None  # when its kill was asked for (timeout, its client gone)


class Host:
    def __init__(self, *, conn: _socket.socket | None = None, listener: _socket.socket | None = None,
                 name: str = "", idle_s: float = 0.0) -> None:
        self.listener, self.name, self.idle_s = listener, name, idle_s
        self.conns: list[_socket.socket] = [conn] if conn is not None else []
        self.private = conn is not None  # its one client's EOF stops the cell
        self.sup: Any = None  # (run_once: the session's cell, in this process)
        self.cell: Any = None  # a live cell: split.Relayed (its keeper's connection) or split.Here
        self.kept = False  # this process is a live cell's keeper (split.keep), not its clients' relay
        self.host_pid = os.getpid()  # the host's (a relay's keeper: the pid its starter was told)
        self.cell_lock: int | None = None  # (run_once: a session cell's lock, held until this process ends)
        self.execs: dict[int, _Exec] = {}
        self.next_id = 0
        self.stopping = False
        self.ended: str | None = None
        self.stop_reason = ""
        self.stop_at = 0.0
        self.failed = ""  # the host's own failure, never reported as an escape
        self.last_look = 0.0
        self.lane = False  # the private client has a lane to the exec server (its commands are not seen here)
        self.result: dict[str, Any] | None = None
        self.send_lock = threading.Lock()  # the monitor's thread reports events too
        self.end_lock = threading.Lock()
        self.started = self.last_work = time.monotonic()
        self.buf: bytearray | None = None
        # A live cell's clients are sent to without waiting (queued): what one cannot take yet waits here, in
        # order, and goes as it can; one stopped reading never holds up the others, the exec server's reports
        # or the cell's end.
        self.queued = False
        self.backlog: dict[_socket.socket, collections.deque[bytes]] = {}
        self.backlog_bytes: dict[_socket.socket, int] = {}
        self.stuck: set[_socket.socket] = set()

    # ---- replies ------------------------------------------------------------------------------------

    def _send(self, conn: _socket.socket, msg: dict[str, Any]) -> None:
        with self.send_lock:
            for attempt in attempts(msg):
                try:
                    if self.queued:
                        self._put(conn, attempt)
                    else:
                        wire.send(conn, attempt)
                    return
                except wire.WireError:
                    continue  # larger than the wire takes: the next, trimmed, does
                except OSError as e:
                    if e.errno == 90:  # EMSGSIZE: larger than one datagram of this socket
                        continue
                    return  # that client has gone; its EOF is handled by the loop

    def _put(self, conn: _socket.socket, msg: dict[str, Any]) -> None:
        """Send without waiting, or queue behind what already waits for ``conn``."""
        if conn in self.stuck:
            return
        data = marshal.dumps(msg)
        if len(data) > wire.MAX_MESSAGE:
            raise wire.WireError(f"{len(data)} bytes")
        waiting = self.backlog.get(conn)
        if waiting is None:
            try:
                conn.sendmsg([data], [], _socket.MSG_DONTWAIT)
                return
            except BlockingIOError:
                waiting = self.backlog[conn] = collections.deque()
        elif len(data) > conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF) - 32:
            raise OSError(90, "larger than one datagram")  # (as sendmsg would say: the caller trims it)
        waiting.append(data)
        self.backlog_bytes[conn] = self.backlog_bytes.get(conn, 0) + len(data)
        if self.backlog_bytes[conn] > MAX_BACKLOG:
            self.stuck.add(conn)  # dropped by the loop, its commands with it

    def _flush(self, conn: _socket.socket) -> None:
        """What waits for ``conn``, as much as it takes now."""
        with self.send_lock:
            waiting = self.backlog.get(conn)
            while waiting:
                try:
                    conn.sendmsg([waiting[0]], [], _socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                except OSError:
                    waiting.clear()  # gone: its EOF is handled by the loop
                    break
                self.backlog_bytes[conn] -= len(waiting.popleft())
            self.backlog.pop(conn, None)
            self.backlog_bytes.pop(conn, None)

    def _flush_cell(self) -> None:
        """The requests that wait for the exec server, as much as it takes now. One that cannot be handed
        over ends the cell (its command and those behind it would wait for good)."""
        try:
            self.cell.live.flush()
        except OSError as e:
            if e.errno not in SERVER_GONE:  # (else the server is gone: so is
                self.failed = self.failed or (  # the cell, and its end, coming, ends their commands: 137, why)
                    f"a request could not be handed to its exec server ({e.strerror or e}); it was killed")
                self.cell.kill()

    def _unstick(self) -> None:
        """Drop the clients that stopped reading past MAX_BACKLOG, as if they had gone."""
        for conn in list(self.stuck):
            if conn in self.conns:
                self._drop(conn)
            self.stuck.discard(conn)

    def _broadcast(self, msg: dict[str, Any]) -> None:
        for conn in list(self.conns):
            self._send(conn, msg)

    def _on_event(self, ev: Any) -> None:
        self._broadcast({"event": "escape" if ev.acts else "note", "data": ev.as_dict()})

    def _relay_event(self, kind: str, data: dict[str, Any]) -> None:
        self._broadcast({"event": kind, "data": data})

    # ---- the cell -----------------------------------------------------------------------------------

    def live(self, conn: _socket.socket, msg: dict[str, Any], then: Any = None) -> int:
        """Open the live cell ``msg`` asks for (``open``) and serve it to its end, then ``then()`` (a named
        cell's linger). In two processes (:mod:`.split`): this one forks the relay, which serves the
        clients, while this one keeps the cell and its monitor (``kept``) and returns once the cell is
        down and the relay has ended; in one when this process has threads (a fork keeps only the
        forking thread). Returns the process's exit status, in each."""
        from . import split

        if threading.active_count() != 1:
            if not self.open(conn, msg):
                return 1
            self.serve()
            (then or self._drain)()
            return 0
        import signal

        keeper, ctl = split.socketpair()
        handled = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        pid = os.fork()
        if pid:  # the keeper: no client's connection, no listener
            ctl.close()
            for c in [*self.conns, *([self.listener] if self.listener is not None else [])]:
                c.close()  # (close, not shutdown: the relay's copies are the same sockets)
            self.conns, self.listener = [], None
            self.kept = True
            return split.keep(keeper, msg, pid, attempts)
        keeper.close()
        if handled:  # (the fork gave the child their default back): a SIGTERM or SIGHUP stops the cell here too
            from ..errors import raise_on_termination

            raise_on_termination()
        self.host_pid = os.getppid()
        opened, channel = split.await_opened(ctl)
        if opened is None or channel is None:
            self._send(conn, opened or {"event": "error", "field": "cell", "code": 123,
                                        "message": "cell: the cell's host ended before the cell started"})
            return 1
        self.cell = split.Relayed(ctl, opened, channel, self._relay_event)
        self._opened(conn, bool(msg.get("lane")))
        self.serve()
        (then or self._drain)()
        return 0

    def _opened(self, conn: _socket.socket, lane: bool) -> None:
        """Tell the client its cell is open; with a lane to the exec server (:mod:`..cell.execd`) if it asks
        for one and is this cell's only client (a private cell: no listener, no idle deadline, which the
        lane's commands, unseen here, would not hold off), and with what it needs to make requests on it:
        the cell's environment and working directory. The lane's commands are the client's to time out; a
        stopped exec server is looked for here while the lane is open, as while commands of ours run. The
        exec server ends with its lane: a client that does not get it (gone) takes the cell with it."""
        opened: dict[str, Any] = {"event": "opened", "cell_id": self.cell.cell_id, "pid1": self.cell.pid1}
        with_lane = {**opened, "env": self.cell.env, "cwd": self.cell.cwd}
        if not (lane and self.private and self.listener is None and not self.idle_s
                and len(marshal.dumps(with_lane)) <= wire.MAX_MESSAGE):
            self._send(conn, opened)
            return
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        try:
            self.cell.live.attach(theirs.fileno())
            self.lane = True
        except OSError:  # the exec server is gone: so is the cell, and its end comes
            pass
        finally:
            theirs.close()
        try:
            if self.lane:
                wire.send(conn, with_lane, [ours.fileno()])
            else:
                self._send(conn, opened)
        except OSError:
            pass  # the client has gone: its EOF is handled by the loop
        finally:
            ours.close()

    def open(self, conn: _socket.socket, msg: dict[str, Any]) -> bool:
        """The live cell in this process (:class:`.split.Here`)."""
        from ..supervise import Supervised
        from .split import Here

        self.queued = True  # (the monitor's thread sends to the clients from its start: never waiting)
        try:
            spec = spec_from_dict(msg["spec"])
            null = os.open(os.devnull, os.O_RDWR)
            try:
                give_to = msg.get("give_to")  # who gets what is moved aside: the client's human
                self.sup = Supervised.start(spec, [], monitor=msg.get("monitor"), callback=self._on_event,
                                            stdio=(null, null, null), live=True,
                                            give_to=(int(give_to[0]), int(give_to[1])) if give_to else None)
            finally:
                os.close(null)
        except AgentcellError as e:
            self._send(conn, {"event": "error", "field": e.field, "message": e.line(), "code": e.exit_code})
            return False
        except (KeyError, TypeError, ValueError) as e:
            self._send(conn, {"event": "error", "field": "request", "message": f"request: malformed: {e}",
                              "code": 125})
            return False
        self.cell = Here(self.sup)
        self._send(conn, {"event": "opened", "cell_id": self.cell.cell_id, "pid1": self.cell.pid1})
        return True

    def serve(self) -> None:
        cell = self.cell
        live = cell.live
        self.buf = wire.buffer()  # (the clients' requests: this loop reads them all)
        self.queued = True
        try:
            while self.ended is None:
                readers: list[Any] = [*self.conns, cell, *([] if live.closed else [live])]
                if self.listener is not None:
                    readers.append(self.listener)
                writers: list[Any] = [*self.backlog, *([live] if live.pending else [])]
                readable, writable = wire.poll(readers, writers, self._wait())
                for w in writable:
                    if w is live:
                        self._flush_cell()
                    else:
                        self._flush(w)
                for r in readable:
                    if r is live:
                        self._reports()
                    elif r is cell:
                        cell.news()
                    elif r is self.listener:
                        self._accept()
                    else:
                        self._request(r)
                self._unstick()
                self._deadlines()
                if cell.over():
                    self._end()
                elif self.private and not self.conns:
                    self._stop("its client has gone")
                elif (self.idle_s and not self.execs and not self.stopping
                      and time.monotonic() - self.last_work > self.idle_s):
                    self._stop(f"idle for {self.idle_s:g} s")
        except Exception as e:  # noqa: BLE001 - a bug here must still end the cell, and say it was ours
            self.failed = f"{type(e).__name__}: {e}"
        finally:
            if self.ended is None:
                self.failed = self.failed or "it was interrupted"
                cell.kill()
                self._end()

    def _wait(self) -> float | None:
        if self.cell.down():
            return None  # its end comes (or its keeper's EOF): no deadline is ours any more
        now = time.monotonic()
        waits = [e.deadline - now for e in self.execs.values() if e.deadline and not e.timed_out]
        graces = [e.killed_at + GRACE_S for e in self.execs.values() if e.killed_at is not None]
        if self.stopping:
            graces.append(self.stop_at + GRACE_S)
        # (one that has passed has had the cell killed: looked at again with the rest, not in a spin)
        waits += [g - now if g > now else LOOK_S for g in graces]
        if self.execs or self.stopping or self.lane:
            waits.append(LOOK_S)
        if self.idle_s and not self.execs:
            waits.append(self.last_work + self.idle_s - now + 0.01)
        return max(0.0, min(waits)) if waits else None

    def _deadlines(self) -> None:
        """Timeouts, and a cell whose exec server no longer serves: a command in the cell runs as the
        same account and can stop (SIGSTOP) or kill it. Then nothing in the cell can be ended by
        request, so the cell ends, whole, from here: an agent that stops its server ends its own cell."""
        now = time.monotonic()
        if self.cell.down():
            return  # the cell has ended: its teardown runs, and its end comes
        if self.failed:
            self.cell.kill()  # (asked again: the keeper may not have taken the last ask; once taken, a no-op)
        for rid, e in self.execs.items():
            if e.deadline is not None and not e.timed_out and now >= e.deadline:
                e.timed_out = True
                self._kill_exec(rid, e)
        stuck = ""
        if any(e.killed_at is not None and now >= e.killed_at + GRACE_S for e in self.execs.values()):
            stuck = f"a command asked to end did not within {GRACE_S:g} s"
        elif self.stopping and now >= self.stop_at + GRACE_S:
            stuck = f"it did not stop within {GRACE_S:g} s of being asked"
        elif (self.execs or self.stopping or self.lane) and now - self.last_look >= LOOK_S:
            self.last_look = now
            if _stopped(self.cell.pid1):
                stuck = "its exec server was stopped by a signal from inside the cell"
        if stuck:
            self.failed = self.failed or f"the cell no longer served commands ({stuck}); it was killed"
            self.cell.kill()

    def _kill_exec(self, rid: int, e: _Exec) -> None:
        if e.killed_at is None:
            e.killed_at = time.monotonic()
        self.cell.live.signal(rid, KILL)

    def _reports(self) -> bool:
        """The ends the exec server has reported; whether there were any."""
        reports = self.cell.live.reports()
        for kind, rid, a, b in reports or []:  # (each a command's end, or its failure to start)
            e = self.execs.pop(rid, None)
            if e is None:
                continue
            self.last_work = time.monotonic()
            self._send(e.conn, end_message(e.cid, kind, a, b, e.started, e.name, e.cwd, e.timed_out))
        return bool(reports)

    def _stop(self, why: str) -> None:
        """No more commands: the exec server ends and PID 1 takes the cell down."""
        if not self.stopping:
            self.stopping, self.stop_reason, self.stop_at = True, why, time.monotonic()
            self.cell.live.close()

    def _end(self) -> None:
        while self._reports():  # what the exec server said before the end (all of it)
            pass
        result = self.cell.result()
        if self.cell.signal:  # the keeper was stopped (SIGTERM, SIGHUP): as this process would be
            self.failed = self.failed or "it was interrupted"
            self.stopping, self.stop_reason = True, f"signal {self.cell.signal}"
        if self.failed:
            reason = f"the cell's host ended it: {self.failed}"
        elif result.get("terminated_by_monitor"):
            reason = f"terminated at an escape attempt: {result.get('monitor_reason')}"
        elif self.stopping:
            reason = f"stopped ({self.stop_reason})"
        else:
            reason = f"the cell ended ({result.get('error') or 'its exec server exited'})"
        self.ended, self.result = reason, result
        for e in self.execs.values():
            self._send(e.conn, {"id": e.cid, "event": "exit", "exit_status": 137, "signal": KILL,
                                "timed_out": e.timed_out, "duration_s": round(time.monotonic() - e.started, 6),
                                "ended": reason})
        self.execs.clear()
        self.cell.live.close()  # (what still waited for the server: its copies of the clients' fds go now)
        self._broadcast({"event": "ended", "reason": reason, "result": result})

    # ---- one command in a cell of its own: the session's harness --------------------------------------

    def run_once(self, conn: _socket.socket, msg: dict[str, Any], fds: list[int]) -> int:
        """:meth:`_run_once`; stopped by SIGTERM or SIGHUP once its cell is started, the cell is killed
        with it (not a verdict of the monitor's: no escape) and the client told how it ended."""
        try:
            return self._run_once(conn, msg, fds)
        except Terminated as e:
            if self.sup is not None:
                own_end = self.sup.running.ended  # (it came once the command's end was taken: that is its end)
                self.sup.running.kill()  # (nothing once its end is taken)
                result = dict(self.sup.wait())
                if not own_end or "exit_status" not in result:  # (not the command's own end: a session says so)
                    result.setdefault("exit_status", None)
                    result.setdefault("signal", None)
                    result["error"] = result.get("error") or f"its host was stopped (signal {e.signum}): the " \
                                                              "cell was killed with it"
                    result["host_ended"] = True
                self._finish_once(result)
            raise

    def _run_once(self, conn: _socket.socket, msg: dict[str, Any], fds: list[int]) -> int:
        """The session's cell: ``argv`` in a cell of its own, on our stdio (the agent's: a terminal
        gets a pty of the cell's own, relayed, as agentcell run does; stdin only in the foreground),
        events as the monitor sees them, stats once a second, ``terminate`` on request; this client's
        EOF (its supervisor died) terminates the cell: no agent runs unwatched."""
        from ..cell import terminal
        from ..supervise import Supervised

        ttys, interactive = terminal.tty_fds(), terminal.is_ours()
        stdio = [0, 1, 2]
        if 0 in ttys and not interactive:
            stdio[0] = os.open(os.devnull, os.O_RDONLY)
            ttys = tuple(fd for fd in ttys if fd != 0)
        try:
            spec = spec_from_dict(msg["spec"])
            argv = [str(a) for a in msg["argv"]]
            if msg.get("session") and spec.cell_id:  # recover must not tear it down while it starts (owner.py)
                from . import owner

                self.cell_lock = owner.hold(spec.cell_id, lambda: _gone(conn))
            made = None
            if msg.get("firewall"):  # the caller's table and its log's socket (the fd that came with this)
                from ..network import firewall, nflog

                fw = msg["firewall"]
                if spec.network != "host-firewall" or len(fds) != 1:
                    raise ValueError("a firewall is handed over with a host-firewall cell and its log's socket")
                table = firewall.HostFirewall(str(fw["table"]), str(fw["record"]))
                if not firewall.exists(table.table):  # fail closed: never a cell without its rule
                    raise ValueError(f"the firewall table {table.table} handed over does not exist")
                table.adopt()
                made = (table, nflog.Reader(_socket_from(fds.pop()), int(fw["group"])))
            dedicated = msg.get("dedicated")  # None: as Supervised decides (an agent account's cell is)
            credentials = None
            if msg.get("credentials"):  # (the values came over the socket: never argv, never a file)
                from ..network.credentials import CredentialSet

                credentials = CredentialSet.from_wire(msg["credentials"])
            self.sup = Supervised.start(spec, argv, monitor=msg.get("monitor", "terminate"), callback=self._on_event,
                                        stdio=stdio, tty_fds=ttys, dedicated=None if dedicated is None else
                                        bool(dedicated), guard=bool(msg.get("guard", True)), adopt=made,
                                        credentials=credentials, upstream_ca=msg.get("upstream_ca"),
                                        on_go=lambda cell_id: self._send(conn, {"event": "going", "cell_id": cell_id}))
        except AgentcellError as e:
            self._send(conn, {"event": "error", "field": e.field, "message": e.line(), "code": e.exit_code})
            return 1
        except (OSError, KeyError, TypeError, ValueError, IndexError) as e:
            self._send(conn, {"event": "error", "field": "cell", "message": f"{type(e).__name__}: {e}",
                              "code": 123})
            return 1
        finally:
            for fd in fds:  # whatever else came with the request
                os.close(fd)
        self._send(conn, {"event": "started", "cell_id": self.sup.cell_id, "pid1": self.sup.pid1})
        master = self.sup.running.pty_master
        if master is None:
            self._control(conn, until_end=True)
            return 0
        # The relay needs this (main) thread for SIGWINCH; the client's requests are served beside it.
        threading.Thread(target=self._control, args=(conn, False), name="agentcell-host", daemon=True).start()
        terminal.Relay(master, interactive).pump(self.sup.running, None)
        self._finish_once(self.sup.wait())
        return 0

    def _finish_once(self, result: dict[str, Any]) -> None:
        with self.end_lock:  # the relay (main thread) and the control thread may both get here
            if self.ended is not None:
                return
            self.ended = "ended"
        self._broadcast({"event": "ended", "reason": "", "result": result})

    def _control(self, conn: _socket.socket, until_end: bool) -> None:
        last_stats = 0.0
        while self.ended is None:
            if until_end:
                result = self.sup.poll()
                if result is not None:
                    self._finish_once(result)
                    return
            if time.monotonic() - last_stats >= 1.0:
                last_stats = time.monotonic()
                self._send(conn, {"event": "stats", "stats": self.sup.stats()})
            # Woken by the client, or (until_end) by the cell's status pipe: its end is seen at once, not
            # at the next look (a 50 ms look cost every supervised run through the warm launcher ~25 ms).
            watched = [conn, self.sup.running] if until_end else [conn]
            if conn not in wire.ready(watched, max(0.0, last_stats + 1.0 - time.monotonic()) if until_end else 0.05):
                continue
            msg, fds = wire.recv_or_gone(conn)
            for fd in fds:
                os.close(fd)
            if msg is None:  # the session's supervisor is gone: fail closed
                self.sup.terminate("the session's supervisor is gone")
                if until_end:
                    self._finish_once(self.sup.wait())
                return
            if msg.get("op") == "terminate":
                self.sup.terminate(str(msg.get("reason") or "terminated"))
            elif msg.get("op") == "signal":  # forwarded by agentcell run (its timeout: SIGKILL)
                sig = msg.get("sig")
                if isinstance(sig, int) and 0 < sig <= MAX_SIG:
                    self.sup.running.forward(sig)

    # ---- clients ------------------------------------------------------------------------------------

    def _drain(self) -> None:
        """The cell has ended: what still waits for its clients (its last events, the commands' ends, the
        cell's) goes as each takes it, until each has it or has gone (as a blocking send would wait); not
        when the host was stopped by a signal (then it ends now)."""
        while self.backlog and not self.cell.signal:
            self._unstick()
            waiting = [c for c in self.backlog if c in self.conns]
            if not waiting:
                break
            readable, writable = wire.poll(waiting, waiting, None)
            for w in writable:
                self._flush(w)
            for r in readable:  # (a request now is answered by nothing: the client learns of the end)
                msg, fds = wire.recv_or_gone(r)
                for fd in fds:
                    os.close(fd)
                if msg is None:
                    self._drop(r)
        self.backlog.clear()
        self.backlog_bytes.clear()

    def linger(self, seconds: float) -> None:
        """A named cell that has ended keeps answering for a while, so that the next ``exec`` (or
        ``list``) learns why (an escape) instead of finding no cell; ``stop`` ends this at once. What
        still waits for a client goes meanwhile."""
        until = time.monotonic() + seconds
        while self.listener is not None and not self.stopping and time.monotonic() < until:
            readers: list[Any] = [self.listener, *self.conns]
            readable, writable = wire.poll(readers, [c for c in self.backlog if c in self.conns],
                                       max(0.0, until - time.monotonic()))
            for w in writable:
                self._flush(w)
            for r in readable:
                if r is self.listener:
                    self._accept()
                    continue
                msg, fds = wire.recv_or_gone(r)
                for fd in fds:
                    os.close(fd)
                if msg is None:
                    self._drop(r)
                elif msg.get("op") == "status":
                    self._send(r, self._status())
                else:
                    self.stopping = msg.get("op") == "stop"
                    self._send(r, {"event": "ended", "reason": self.ended, "result": self.result})

    def _status(self) -> dict[str, Any]:
        return {"event": "status", "name": self.name, "pid": self.host_pid, "cell_id": self.cell.cell_id,
                "pid1": self.cell.pid1, "execs": len(self.execs), "events": self.cell.events_seen(),
                "uptime_s": time.monotonic() - self.started, "ended": self.ended}

    def _accept(self) -> None:
        conn = peer.accept_ours(self.listener)
        if conn is not None and len(self.conns) >= MAX_CLIENTS:  # each is an fd of ours: a bounded number
            conn.close()
        elif conn is not None:
            self.conns.append(conn)

    def _drop(self, conn: _socket.socket) -> None:
        for rid, e in list(self.execs.items()):
            if e.conn is conn:  # a client that went away takes its commands with it
                self._kill_exec(rid, e)
        self.conns.remove(conn)
        with self.send_lock:  # (the monitor's thread may be sending to it: the in-process cell, split.Here)
            self.backlog.pop(conn, None)
            self.backlog_bytes.pop(conn, None)
            conn.close()

    def _request(self, conn: _socket.socket) -> None:
        msg, fds = wire.recv_or_gone(conn, self.buf)
        try:
            if msg is None:
                self._drop(conn)
            else:
                try:
                    self._handle(conn, msg, fds)
                except (KeyError, TypeError, ValueError, OverflowError) as e:  # a client's bad request, not ours
                    self._send(conn, {"id": msg.get("id"), "event": "error", "field": "request", "code": 125,
                                      "message": f"request: malformed: {type(e).__name__}: {e}"})
        finally:
            for fd in fds:
                os.close(fd)

    def _handle(self, conn: _socket.socket, msg: dict[str, Any], fds: list[int]) -> None:
        op = msg.get("op")
        if op == "status":
            self._send(conn, self._status())
        elif op == "stop":
            self._stop("asked to stop")
        elif op == "signal":
            sig = msg["sig"]
            if not isinstance(sig, int) or not 0 < sig <= MAX_SIG:
                raise ValueError(f"sig must be a signal number (1-{MAX_SIG})")
            rid = next((r for r, e in self.execs.items() if e.conn is conn and e.cid == msg.get("id")), None)
            if rid is not None:
                self.cell.live.signal(rid, sig)
        elif op == "exec":
            self._exec(conn, msg, fds)
        else:
            self._send(conn, {"id": msg.get("id"), "event": "error", "field": "op", "code": 125,
                              "message": f"op: unknown {op!r}"})

    def _exec(self, conn: _socket.socket, msg: dict[str, Any], fds: list[int]) -> None:
        cid = msg.get("id")
        try:
            if not isinstance(cid, int) or isinstance(cid, bool):
                raise ValueError("id must be a number")
            argv, extra, cwd, timeout = msg["argv"], msg.get("env") or {}, msg.get("cwd"), msg.get("timeout")
            wrong = malformed(argv, extra, cwd)
            if wrong:
                raise ValueError(wrong)
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                        or not math.isfinite(timeout) or timeout <= 0):
                raise ValueError("timeout must be a positive, finite number of seconds")
            if self.stopping:
                raise ValueError("the cell is stopping")
            if len(fds) != 3:
                raise ValueError("stdin, stdout and stderr must come with the request")
        except (KeyError, TypeError, ValueError) as e:
            self._send(conn, {"id": cid, "event": "error", "field": "exec", "code": 125, "message": f"exec: {e}"})
            return
        base = self.cell.env
        env = {**base, **encoded(extra)} if extra else base
        cwd = cwd or self.cell.cwd
        self.next_id += 1
        rid = self.next_id
        self.last_work = time.monotonic()
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        self.execs[rid] = _Exec(conn, int(cid or 0), deadline, argv[0], cwd)
        try:
            self.cell.live.exec(rid, argv, env, cwd, dict(enumerate(fds)))
        except OSError as e:
            if e.errno in SERVER_GONE:
                return  # the exec server is gone, so is the cell: its end, coming, ends this command (137, why)
            del self.execs[rid]
            self._send(conn, {"id": cid, "event": "error", "field": "exec", "code": 125,
                              "message": f"exec: {e.strerror or e}"})
        except ValueError as e:
            del self.execs[rid]
            self._send(conn, {"id": cid, "event": "error", "field": "exec", "code": 125, "message": f"exec: {e}"})


def attempts(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """``msg``, then smaller versions of it (its result's lists cut), to send in turn until one fits."""
    return [msg, _trimmed(msg, 100, 4), _trimmed(msg, 10, 0)]


def _trimmed(msg: dict[str, Any], events: int, ancestry: int) -> dict[str, Any]:
    """``msg`` with its result's lists cut to fit one datagram: the agent decides how many events (and
    how deep their ancestry) a cell produces, and a result that does not fit must not be lost whole.
    What was cut is counted in ``trimmed``."""
    result = msg.get("result")
    if not isinstance(result, dict):
        return msg
    out = dict(result)
    cut: dict[str, int] = {}
    for key, keep in (("events", events), ("egress_blocked", events)):
        items = out.get(key)
        if isinstance(items, list) and len(items) > keep:
            out[key], cut[key] = items[:keep], len(items) - keep
    if isinstance(out.get("events"), list):
        out["events"] = [dict(e, ancestry=(e.get("ancestry") or [])[:ancestry]) if isinstance(e, dict) else e
                         for e in out["events"]]
    out["trimmed"] = cut
    return dict(msg, result=out)


def _socket_from(fd: int) -> Any:
    import socket

    return socket.socket(fileno=fd)


def _gone(conn: _socket.socket) -> bool:
    """The client has closed its end (its process died), with nothing left to read."""
    try:
        return conn.recv(1, _socket.MSG_PEEK | _socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


PF_FORKNOEXEC = 0x40  # a task's flag: forked, has not exec'd yet


def _children(pid: int) -> list[str]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return f.read().split()


def _stopped(pid1: int) -> bool:
    """Is the exec server stopped, by a signal or a tracer? It is PID 1's child that is pid 2 in the
    cell (PID 1's first fork); orphans of the cell are PID 1's children too. Stopped too when a child of
    its own is stopped before its exec: the server waits on that child (posix_spawn is a vfork) for as
    long (in D, the vfork's wait), and serves nothing. (Not any stopped child that never exec'd: a command
    can give the server one, by clone with CLONE_PARENT; the server is not in D for that.)"""
    try:
        for child in _children(pid1):
            with open(f"/proc/{child}/status") as f:
                status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            if status.get("NSpid", "").split()[-1:] == ["2"]:
                state = status.get("State", "").split()[:1]
                return state in (["T"], ["t"]) or (state == ["D"] and _spawn_stopped(int(child)))
    except (OSError, ValueError):
        pass
    return False


def _spawn_stopped(server: int) -> bool:
    """A child of the exec server is stopped between its spawn and its exec."""
    try:
        children = _children(server)
    except OSError:
        return False
    for child in children:
        try:
            fields = hostfs.proc_stat(child)
            stopped_before_exec = fields[0] in (b"T", b"t") and int(fields[6]) & PF_FORKNOEXEC
        except (OSError, IndexError, ValueError):
            continue
        if stopped_before_exec:
            return True
    return False


def serve_private(conn: _socket.socket, msg: dict[str, Any] | None, fds: list[int]) -> int:
    """Serve one private client's cell, from its first request (``run`` or ``open``) to the cell's end:
    as a process of its own started with ``--conn``, or forked by the warm launcher
    (:mod:`agentcell.host.zygote`), which hands over the client's connection and that request."""
    host = Host(conn=conn)
    if msg is not None and msg.get("op") == "run":
        return host.run_once(conn, msg, fds)
    for fd in fds:
        os.close(fd)
    if msg is None or msg.get("op") != "open":
        return 1
    return host.live(conn, msg)


def main(argv: list[str]) -> int:
    """A cell host of its own. SIGTERM or SIGHUP takes its cell down (killed, its teardown run, its socket
    removed) as ``stop`` would, and ends it with 128+N."""
    import signal

    from ..errors import raise_on_termination

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the client's to act on
    raise_on_termination()
    try:
        return _main(argv)
    except Terminated as e:
        return 128 + e.signum


def _main(argv: list[str]) -> int:
    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    if "--conn" in opts:
        conn = _socket.socket(fileno=int(opts["--conn"]))
        msg, fds = wire.recv_or_gone(conn)
        return serve_private(conn, msg, fds)
    listener = _socket.socket(fileno=int(opts["--listen"]))
    peer.listen_here(listener, MAX_CLIENTS)
    ino = os.stat(opts["--path"]).st_ino
    host = Host(listener=listener, name=opts.get("--name", ""), idle_s=float(opts.get("--idle", "0")))
    fd, _addr = listener._accept()  # type: ignore[attr-defined]  # the starter, who opens the cell
    conn = _socket.socket(fileno=fd)
    if not peer.peer_is_ours(conn):
        return 1
    host.conns.append(conn)
    msg, fds = wire.recv_or_gone(conn)
    for fd in fds:
        os.close(fd)
    if msg is None or msg.get("op") != "open":
        return 1

    def linger() -> None:
        if not host.stopping:
            host.linger(LINGER_S)

    try:
        return host.live(conn, msg, linger)
    finally:
        path = opts.get("--path")
        if path and not host.kept:  # (the relay's: it lingers, then removes it)
            try:
                if os.stat(path).st_ino == ino:  # still ours
                    os.unlink(path)
            except OSError:
                pass
    return 0
