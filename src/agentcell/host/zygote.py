"""The warm launcher: a single-threaded process that forks cells on request.

A long-lived, multi-threaded program must never fork (a lock held by another thread stays locked in
the child), so :class:`agentcell.Cell` starts this process once with ``subprocess`` (fork+exec is safe)
and asks it, over a private socketpair, to launch cells. ``agentcell warm start`` runs the same
server on a listening socket for ``agentcell run`` (see :mod:`agentcell.host.warm`). stdio fds travel
with each request (SCM_RIGHTS); the protocol is in :mod:`agentcell.host.wire`. Every launch is a
fresh cell: nothing is reused between commands.

Pre-warming: when idle (in a burst of requests, as soon as a request's cell runs), the launcher prepares
the next cell for the policy of the last request (namespaces, mounts, pivot_root and the Landlock
ruleset done; its command process waits for argv), so the next request only hands over argv and fds
and execs. A prepared cell has never run anything; it is discarded if the next request carries another
policy, and when the launcher stops.
"""
from __future__ import annotations

import _socket
import gc
import os
import select
import sys
import time

from ..cell import launch, pid1
from ..cell import syscalls as sc
from ..cell.spec import TYPE_CHECKING, CellSpec, spec_from_dict
from ..errors import AgentcellError, Terminated, ignore_termination, raise_on_termination
from ..protect import binds
from . import clihost, peer, server, starter, wire

if TYPE_CHECKING:
    import signal
    from typing import Any

    Sock = _socket.socket
else:  # (signal.py imports enum; see cell/launch.py)
    import _signal as signal


PROGRAMS_HELD_S = 60.0
# A spawn this soon after the last cell's end is one of a burst (a loop, not an agent's tool calls, which
# come seconds apart): the next cell is prepared as soon as its cell runs, not when the launcher is idle
# again, which would leave the next request waiting for a build. Preparing it while a command runs costs
# that command's end a few ms (the launcher's part of the build comes first).
BURST_S = 0.04


def _prepare(spec: CellSpec) -> launch.Prepared:
    spec = spec.replace(cell_id="")  # every cell gets its own id
    return launch.prepare(spec, binds.for_cell(spec))


class _Warm:
    """At most one prepared cell, for the policy of the last request."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.cell: launch.Prepared | None = None
        self.wanted: CellSpec | None = None

    def take(self, spec: CellSpec) -> launch.Prepared:
        if self.enabled:
            self.wanted = spec
        cell, self.cell = self.cell, None
        if cell is not None and cell.spec == spec:
            return cell
        if cell is not None:
            cell.discard()
        return _prepare(spec)

    def refill(self) -> None:
        if self.wanted is None or self.cell is not None:
            return
        try:
            self.cell = _prepare(self.wanted)
        except (AgentcellError, OSError):  # (out of processes, say)
            self.wanted = None  # the next request prepares (and reports) it in the foreground

    def drop(self) -> None:
        if self.cell is not None:
            self.cell.discard()
            self.cell = None


class Server:
    def __init__(self, *, listener: Sock | None = None, conn: Sock | None = None, prewarm: bool = True,
                 idle_s: float = 0.0) -> None:
        self.listener = listener
        self.conns: list[Sock] = [conn] if conn is not None else []
        self.control = conn  # a private client's first connection: its end is the launcher's
        self.cells: dict[tuple[int, int], launch.Running] = {}  # (conn fd, request id) -> cell
        self.retiring: dict[int, launch.Running] = {}  # C1's pidfd -> a cell whose cgroup goes once C1 has exited
        self.hosts: dict[int, int] = {}  # pidfd -> pid of a cell host forked for a supervised cell, or of a CLI
        self.fronts: dict[int, Sock] = {}  # pidfd -> the front's connection, for a CLI forked for it (op cli)
        self.fronts_served = 0
        self.ahead: clihost.Ahead | None = None  # a front's next CLI, forked ahead (once a front has come)
        self.starter: starter.Starter | None = None  # forks a front's session start (once one has come)
        self.programs: Any = None  # the monitor's host programs, held while watched cells come (monitor.calls.hold)
        self.programs_until = 0.0
        self.warm = _Warm(prewarm)
        self.idle_s = idle_s
        self.started = self.last_work = time.monotonic()
        self.last_end = 0.0  # when the last spawned cell's end was told
        self.stopping = False

    def serve(self) -> None:
        try:
            self._loop()
        finally:
            for key in list(self.cells):
                self._kill(key)
            for pidfd in list(self.retiring):
                self._retired(pidfd)
            self.warm.drop()
            if self.ahead is not None:
                self.ahead.discard()
            if self.starter is not None:
                self.starter.discard()
            self._let_programs_go()

    def _loop(self) -> None:
        while not self.stopping:
            if self.listener is None and not self.conns:
                return  # the one private client has gone
            # Prepare the next cell when idle (or, in a burst, as soon as a spawn's cell runs: BURST_S).
            if not self.cells and not self.hosts:
                self.warm.refill()
                if self.ahead is None and self.fronts_served:
                    self.ahead = clihost.Ahead(self._detach)
                    self.conns.append(self.ahead.conn)
            readers: list[Any] = [*self.conns, *self.cells.values(), *self.hosts, *self.retiring]
            if self.listener is not None:
                readers.append(self.listener)
            if self.starter is not None:
                readers.append(self.starter.sock)
            wait = None
            if self.idle_s and not self.cells and not self.hosts:
                wait = self.last_work + self.idle_s - time.monotonic()
                if wait <= 0:
                    return  # no command for idle_s (status queries do not count): go away
            if self.programs is not None and not self.hosts:
                left = self.programs_until - time.monotonic()
                if left <= 0:
                    self._let_programs_go()
                else:
                    wait = left if wait is None else min(wait, left)
            ready, _, _ = select.select(readers, [], [], wait)
            for r in ready:
                if isinstance(r, launch.Running):
                    self._progress(r)
                elif r in self.retiring:
                    self._retired(r)
                elif isinstance(r, int):
                    self._reap(r)
                elif r is self.listener:
                    self._accept()
                elif self.starter is not None and r is self.starter.sock:
                    self._starter_gone()  # (it says nothing: readable means it has ended)
                else:
                    self._request(r)

    def _accept(self) -> None:
        conn = peer.accept_ours(self.listener)
        if conn is not None:
            self.conns.append(conn)

    def _request(self, conn: Sock) -> None:
        msg, fds = wire.recv_or_gone(conn)
        try:
            if msg is None:
                self._drop_conn(conn)
            else:
                self._handle(conn, msg, fds)
        except Exception:  # noqa: BLE001 - one request the code did not foresee ends its connection, never the
            if conn in self.conns:  # launcher and the other clients' cells
                self._drop_conn(conn)
        finally:
            for fd in fds:
                os.close(fd)

    def _drop_conn(self, conn: Sock) -> None:
        for pidfd, front in self.fronts.items():
            if front is conn:  # the front has gone (killed, as a CLI may be): so does its CLI's process, and its
                try:  # cell with the CLI's connection (a front's SIGTERM, SIGINT or SIGHUP is forwarded to it)
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                del self.fronts[pidfd]
                break
        if conn is self.control:
            self.stopping = True  # (the cells of its other connections are killed as the launcher stops)
        for key in [k for k in self.cells if k[0] == conn.fileno()]:
            self._kill(key)  # a client that went away takes its cells with it
        self.conns.remove(conn)
        conn.close()

    def _kill(self, key: tuple[int, int]) -> None:
        cell = self.cells.pop(key)
        cell.kill()
        cell.wait()

    def _reply(self, conn: Sock, msg: dict[str, object]) -> None:
        try:
            wire.send(conn, msg)
        except OSError:
            pass  # the client went away; its EOF is handled on the next round

    def _handle(self, conn: Sock, msg: dict[str, Any], fds: list[int]) -> None:
        op = msg.get("op")
        if op == "attach" and self.control is conn and len(fds) == 1:
            # Another connection of our private client's (a cell of its own each: see host.remote).
            # Only there: the user's warm launcher takes connections by listen(), each peer checked.
            self.conns.append(_socket.socket(fileno=os.dup(fds[0])))
            return
        if op == "cli" or conn in self.fronts.values():
            self.last_work = time.monotonic()
            self._front(conn, msg, fds)
            return
        if op in ("run", "open"):  # a supervised cell: a host of its own takes this client over
            self.last_work = time.monotonic()
            self._hold_programs()
            self._host(conn, msg, fds)
            return
        if op == "status":
            self._reply(conn, {"event": "status", "pid": os.getpid(), "cells": len(self.cells) + len(self.hosts),
                               "warm": self.warm.cell is not None, "uptime_s": time.monotonic() - self.started,
                               "fronts_served": self.fronts_served,
                               "cli_ahead": self.ahead.pid if self.ahead is not None else None,
                               "session_starter": self.starter.pid if self.starter is not None else None})
            return
        if op == "stop":
            self.stopping = True
            self._reply(conn, {"event": "stopping"})
            return
        rid, sig = msg.get("id", 0), msg.get("sig")
        if not isinstance(rid, int) or (op == "signal" and not (isinstance(sig, int) and 0 < sig <= 64)):
            self._reply(conn, {"event": "error", "field": "request", "message": "malformed: id and sig are "
                               "small integers", "code": 125})  # never a reason to stop serving the others
            return
        key = (conn.fileno(), rid)
        if op == "signal":
            if key in self.cells:
                self.cells[key].signal(int(sig))  # type: ignore[arg-type]
            return
        if op != "spawn":
            self._reply(conn, {"id": rid, "event": "error", "field": "op", "message": f"unknown op {op!r}",
                               "code": 125})
            return
        self.last_work = arrived = time.monotonic()
        try:
            spec = spec_from_dict(msg["spec"])
            if spec.network in ("proxy", "host-firewall") or spec.watch:  # its proxy, table or monitor: a host's
                raise AgentcellError("op", f"a {'watched' if spec.watch else spec.network} cell is served by a cell "
                                     "host: ask with op 'run'", "update the client (agentcell run does so)")
            argv = [str(a) for a in msg["argv"]]
            prepared = self.warm.take(spec)
            # from here the command may have run: a client that loses us after this never runs it again
            self._reply(conn, {"id": rid, "event": "going", "cell_id": prepared.cell_id})
            self.cells[key] = running = prepared.go(argv, stdio=fds)
            while not running.pid1 and not running.finished_reading():  # (said by the cell while it was prepared)
                running.poll_messages(0.05)
            self._reply(conn, {"id": rid, "event": "started", "cell_id": self.cells[key].cell_id,
                               "pid1": running.pid1})
            if arrived - self.last_end < BURST_S:  # (else when idle)
                self.warm.refill()
        except AgentcellError as e:
            self._reply(conn, {"id": rid, "event": "error", "field": e.field, "message": e.line(),
                               "code": e.exit_code})
        except (KeyError, TypeError, ValueError) as e:
            self._reply(conn, {"id": rid, "event": "error", "field": "request", "message": f"malformed: {e}",
                               "code": 125})

    def _host(self, conn: Sock, msg: dict[str, Any], fds: list[int]) -> None:
        """Fork a cell host (:func:`agentcell.host.server.serve_private`) for this client: its monitor,
        proxy and host-firewall table live there, with threads of their own, never here (this process
        forks cells and must stay single-threaded). The client's connection and stdio go to the host,
        which serves that one cell to its end; this process only reaps it. A ``run`` request brings
        stdin, stdout and stderr: they become the host's 0, 1, 2 (the command's, as agentcell run's)."""
        if any(k[0] == conn.fileno() for k in self.cells):  # its results and signals are keyed by this fd
            self._reply(conn, {"event": "error", "field": "request", "message": "a connection with cells running "
                               "cannot be handed to a cell host: open another", "code": 125})
            return
        self.conns.remove(conn)  # the host's alone from now on: two readers of one socket would race
        if msg.get("op") == "run" and len(fds) < 3:
            self._reply(conn, {"event": "error", "field": "request", "message": "a run brings stdin, stdout and "
                               "stderr", "code": 125})
            conn.close()
            return
        pid = os.fork()
        if pid == 0:  # the host: nothing of the launcher's but this client's socket and fds
            code = 1
            try:  # (nothing passes this process's end: never the launcher's frames, their cleanup is theirs)
                code = self._serve_host(conn, msg, fds)
            finally:
                os._exit(code)
        conn.close()
        self.hosts[os.pidfd_open(pid)] = pid

    def _serve_host(self, conn: Sock, msg: dict[str, Any], fds: list[int]) -> int:
        """In the forked host: serve the client's cell; the status to exit with."""
        code = 1
        try:
            try:
                keep = {conn.fileno(), *fds}
                if msg.get("op") == "run":
                    for i in range(3):
                        os.dup2(fds[i], i)
                    keep -= set(fds[:3])
                    fds = fds[3:]
                self._detach()
                sc.close_fds_except(keep)  # other clients, prepared and running cells, the listener
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client acts on a terminal's ^C
                # A SIGTERM or SIGHUP takes the cell down as a cold host's does (the fork gave them their
                # default: the host died of one and left its cell's cgroup and table)
                raise_on_termination()
                code = server.serve_private(conn, msg, list(fds))
            except Terminated as e:
                code = 128 + e.signum
            finally:
                ignore_termination()
        except Terminated as e:  # (one that came as the host's end began)
            code = code or 128 + e.signum
        finally:
            clihost.settle()  # (its cell's rings out of the host's maps: after the client has its end)
        return code

    def _hold_programs(self) -> None:
        """The user's warm launcher, as root, holds the monitor's programs (those that see every cell's
        failed calls, execs and tasks) while watched cells come, and for PROGRAMS_HELD_S after the last:
        each cell host's monitor joins them instead of loading and attaching them again. They watch only
        the cgroups of watched cells; none is added while no cell runs."""
        if self.listener is None or os.geteuid() != 0:
            return  # (a private launcher serves one client; a user's cells are watched by other means)
        self.programs_until = time.monotonic() + PROGRAMS_HELD_S
        if self.programs is None:
            from ..monitor import calls

            try:
                self.programs = calls.hold()
            except OSError:
                self.programs_until = 0.0  # (each cell's monitor says why it cannot load them)

    def _let_programs_go(self) -> None:
        if self.programs is not None:
            from ..monitor import hostprog

            hostprog.release(self.programs)
            self.programs = None

    def _detach(self) -> None:
        """In a child forked here: the launcher's sockets are forgotten (their fds are closed next), so
        that no finalizer closes a number the child has reused."""
        prepared = [self.warm.cell.control] if self.warm.cell is not None else []
        ours = [s for s in (self.listener, self.starter and self.starter.sock) if s]
        for sock in (*self.conns, *ours, *prepared):
            sock.detach()

    def _front(self, conn: Sock, msg: dict[str, Any], fds: list[int]) -> None:
        """The compiled front's ``agentcell run`` (:mod:`.clihost`): a forked process becomes that CLI;
        the front's signals are forwarded to it and its status is the front's answer."""
        if msg.get("op") == "signal":
            sig = msg.get("sig")
            pidfd = next((p for p, c in self.fronts.items() if c is conn), None)
            if pidfd is not None and isinstance(sig, int) and 0 < sig <= 64:
                try:
                    signal.pidfd_send_signal(pidfd, sig)
                except ProcessLookupError:
                    pass
            return
        why = "a connection serves one command" if conn in self.fronts.values() else clihost.refusal(msg, fds)
        if why:
            self._reply(conn, {"event": "refused", "why": why})
            return
        self._reply(conn, {"event": "started"})  # (before the hand-over: the front never runs it twice)
        self.fronts_served += 1
        if clihost.served(msg["argv"]) == "session" and self._start_session(msg, fds, conn):
            return
        ahead, self.ahead, why = self.ahead, None, ""
        for _ in range(2):  # the process forked ahead; or (none, or it has died) one forked now
            if ahead is None:
                try:
                    ahead = clihost.Ahead(self._detach, warm_up=False)
                    self.conns.append(ahead.conn)
                except OSError as e:
                    why = f"cannot fork: {e.strerror}"
                    break
            if ahead.hand(msg, fds, conn.fileno()):
                self.hosts[ahead.pidfd] = ahead.pid
                self.fronts[ahead.pidfd] = conn
                return
            ahead.discard()
            ahead, why = None, "its process for this run ended before it took it"
        os.write(fds[3], f"agentcell: warm launcher: {why}\n".encode())
        self._reply(conn, {"event": "exit", "code": 125})

    def _start_session(self, msg: dict[str, Any], fds: list[int], conn: Sock) -> bool:
        """A front's ``session start`` to the session starter (forked on the first), with the front's
        connection: from here on the session's alone (its signals, its hang-up, its status: see
        :mod:`.starter`), and this process forgets it. False if the starter could not take it (it has
        gone: a process forked now runs the session instead, imports and all)."""
        for _ in range(2):
            if self.starter is None:
                try:
                    self.starter = starter.Starter(self._detach)
                except OSError:
                    return False
            if self.starter.take(msg, fds, conn):
                self.conns.remove(conn)
                conn.close()
                return True
            self._starter_gone()
        return False

    def _starter_gone(self) -> None:
        """The starter has ended (its sessions go on, each with its front); the next session start forks
        another."""
        st, self.starter = self.starter, None
        if st is not None:
            st.discard()

    def _reap(self, pidfd: int) -> None:
        pid = self.hosts.pop(pidfd)
        os.close(pidfd)
        try:
            _, wstatus = os.waitpid(pid, 0)
        except ChildProcessError:
            wstatus = 1 << 8
        front = self.fronts.pop(pidfd, None)
        if front is not None:  # its status is the front's answer; the connection has served its one command
            self._reply(front, {"event": "exit", "code": pid1.status_of(wstatus)[0]})
            self.conns.remove(front)
            front.close()
        self.last_work = time.monotonic()

    def _progress(self, running: launch.Running) -> None:
        running.poll_messages(0)
        if not (running.finished_reading() or running.reported()):
            return
        key = next(k for k, v in self.cells.items() if v is running)
        del self.cells[key]
        self.last_work = time.monotonic()
        result = running.wait(clean_up=False).as_dict()
        conn = next((c for c in self.conns if c.fileno() == key[0]), None)
        if conn is not None:
            self._reply(conn, {"id": key[1], "event": "exit", "result": result})
        self.last_end = time.monotonic()
        pidfd = running.retire()  # neither the client nor the next request waits for the cgroup's removal
        if pidfd is not None:
            self.retiring[pidfd] = running

    def _retired(self, pidfd: int) -> None:
        os.close(pidfd)
        self.retiring.pop(pidfd).clean_up()


def main(argv: list[str]) -> None:
    """``python -m agentcell.host.zygote --conn FD [--no-prewarm]``, or as the daemon of
    ``agentcell warm start``: ``--listen FD --path SOCKET [--idle S]``."""
    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    prewarm = "--no-prewarm" not in argv
    if "--conn" not in opts:  # the daemon: what a supervised cell's host and a front's CLI need, imported once
        clihost.preload()
        from .. import supervise  # noqa: F401
        from ..cell import terminal  # noqa: F401
        from ..monitor import monitor  # noqa: F401
        from ..network import firewall, nflog, proxy  # noqa: F401
        from ..protect import check  # noqa: F401

        gc.collect()
        gc.freeze()  # (shared with every process forked here: out of the collector's sight, not copied by it)
    if "--conn" in opts:
        Server(conn=_socket.socket(fileno=int(opts["--conn"])), prewarm=prewarm).serve()
    else:
        listener = _socket.socket(fileno=int(opts["--listen"]))
        peer.listen_here(listener, 64)
        path = opts["--path"]
        ino = os.stat(path).st_ino
        try:
            Server(listener=listener, prewarm=prewarm, idle_s=float(opts.get("--idle", "900"))).serve()
        finally:
            try:
                if os.stat(path).st_ino == ino:  # still ours: a newer launcher may have replaced it
                    os.unlink(path)
            except OSError:
                pass


if __name__ == "__main__":
    main(sys.argv[1:])

