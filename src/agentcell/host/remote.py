"""The remote host: cells in processes of their own, spoken to over the host protocol (:mod:`.wire`).

This module alone starts a launcher (:mod:`.zygote`) or a cell host (:mod:`.server`), speaks the wire,
decodes the errors that come back and chooses the op, so that :class:`agentcell.Cell`,
:class:`agentcell.LiveCell`, the session and ``agentcell run``'s warm path are short callers of one
client. The op follows from what lives beside the cell:

* a cell with nothing beside it (no proxy, no host-firewall table, no monitor) is a launcher's
  ``spawn``: the launcher forks it from a cell it prepared while idle;
* a cell with a proxy, a table or a monitor is a cell host's ``run``: the launcher forks that host
  (:func:`.server.serve_private`) and hands it the connection, or, with no launcher at hand, a cell
  host is started for it (the session's harness, whose stdio are the host's own);
* a live cell is a cell host's ``open`` (:class:`RemoteLive`).

Each cell has a connection of its own, so a handle reads only its own messages and needs no thread;
a private launcher gives out connections through its control socket (op ``attach``). Importing this
module costs what the warm path of ``agentcell run`` already pays (no subprocess, threading or
typing until a launcher or a live cell is started).
"""
from __future__ import annotations

import _socket
import _thread
import os
import select
import stat
import time

from .. import hostfs
from ..cell.spec import TYPE_CHECKING, CellSpec, spec_to_dict
from ..errors import EXIT_TIMEOUT, AgentcellError, LaunchError
from . import interp, peer, wire

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Sequence
    from typing import Any

    from ..protect.check import SurfaceCheck
    from .base import StartOptions
    from .liveclient import RemoteLive

SIGKILL = 9
SIGTERM = 15
CLOSE_GRACE_S = 10.0  # a cell asked to end by close() has this long before it is killed outright
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


WARM_SOCKET = "launcher.sock"  # in hostfs.socket_dir()


def _private_dir(d: str) -> bool:
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0


def connect(path: str) -> _socket.socket | None:
    """A connection to a server of ours listening at ``path`` (a warm launcher, a named live cell), or
    None: none listens there, or its peer is not ours (our uid, and not a cell's impostor: a rootless
    cell has our uid)."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        s.connect(path)
        if peer.peer_is_ours(s):
            return s
    except OSError:
        pass
    s.close()
    return None


_given: list[_socket.socket] = []  # a connection to the launcher made as it forked this process (clihost.Ahead)


def given_warm(sock: _socket.socket) -> None:
    """In a process the warm launcher forked to run a front's CLI: its connection to the launcher, made
    before the fork (a socketpair: nothing to find, connect or check), for :func:`connect_warm` to use
    once."""
    _given.append(sock)


def connect_warm() -> _socket.socket | None:
    """A connection to our own running warm launcher (``agentcell warm``), or None."""
    if _given:
        return _given.pop()
    d = hostfs.socket_dir()
    return connect(os.path.join(d, WARM_SOCKET)) if _private_dir(d) else None


def ask(sock: _socket.socket, op: str) -> dict[str, Any] | None:
    """A management op (``status``, ``stop``) and its answer (None: the server has gone). What else comes
    meanwhile (a live cell's events to every client) is passed over."""
    wire.send(sock, {"op": op})
    while True:
        msg, fds = wire.recv_or_gone(sock)
        for fd in fds:
            os.close(fd)
        if msg is None or msg.get("event") in ("status", "stopping", "ended"):
            return msg


class HostUnavailable(LaunchError):
    """The launcher asked for is not there, or went away before the cell started: nothing ran."""


def supervised(spec: CellSpec, monitor: str | None) -> bool:
    """Whether the cell needs a cell host: something lives beside it (proxy, table, monitor)."""
    return monitor is not None or spec.watch or spec.network in ("proxy", "host-firewall")


def host_env() -> dict[str, str]:
    """A launcher's or cell host's environment: almost nothing of its caller's (each cell's comes with its
    policy): a PATH with sbin (a cell host runs nft), a language, and where its sockets live."""
    env = {"PATH": SBIN_PATH, "LANG": os.environ.get("LANG", "C.UTF-8")}
    env.update({k: os.environ[k] for k in ("HOME", "XDG_RUNTIME_DIR", "XDG_STATE_HOME") if k in os.environ})
    return env


def _popen(argv: list[str], stdio: Sequence[int | None], pass_fds: Sequence[int],
           new_session: bool = True) -> subprocess.Popen[bytes]:
    """A launcher or cell host of ours, as a fresh interpreter (fork+exec: safe from threaded callers),
    started in /; ``new_session``: it never shares our terminal's job control (a cell host that runs a
    command on our stdio stays in our session: a terminal there is the command's)."""
    import subprocess

    try:
        return subprocess.Popen(argv, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2], pass_fds=tuple(pass_fds),
                                close_fds=True, cwd="/", start_new_session=new_session, env=host_env())
    except OSError as e:
        raise LaunchError("host", f"cannot start the cell's host: {e.strerror}") from None


def serve_detached(path: str, argv: Callable[[int], list[str]], backlog: int) -> subprocess.Popen[bytes]:
    """Start ``argv(listening fd)``, a server of ours that outlives us (init reaps it), listening on
    ``path``: a SOCK_SEQPACKET socket of mode 0600 in a directory only we may enter (a stale socket
    of a server that is gone is replaced). Its environment is a host's (:func:`host_env`)."""
    import subprocess

    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(backlog)
        proc = subprocess.Popen(argv(listener.fileno()), pass_fds=[listener.fileno()], start_new_session=True,
                                cwd="/", close_fds=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=host_env())
    finally:
        listener.close()
    proc.returncode = 0  # it outlives us on purpose; init reaps it
    return proc


def _pair() -> tuple[_socket.socket, _socket.socket]:
    a, b = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    return a, b


def _surface(spec: CellSpec, options: StartOptions | None) -> SurfaceCheck | None:
    """The protected-path step's first half, when the caller asked for the step (``options.guard``)."""
    if options is None or not options.guard:
        return None
    from ..protect.check import SurfaceCheck, human

    return SurfaceCheck(spec, human())


class RemoteCell:
    """One command in a cell served over a connection of its own: a launcher's ``spawn`` (its end is
    ``exit``) or a cell host's ``run`` (its monitor's events, stats about once a second, ``ended``)."""

    def __init__(self, sock: _socket.socket, proc: subprocess.Popen[bytes] | None, supervised: bool) -> None:
        self._sock, self._proc, self.supervised = sock, proc, supervised
        self._last = "ended" if supervised else "exit"
        self._events: list[dict[str, Any]] = []
        self._stats: dict[str, Any] = {}
        self._result: dict[str, Any] | None = None
        self._eof = False
        self.cell_id, self.pid1 = "", 0
        self.timed_out = self.was_lost = False
        # The protected-path step, when it is this client's: always for a launcher's plain cell; for a
        # supervised one (whose host takes it) only if that host is lost before it could.
        self.surface: SurfaceCheck | None = None

    def _begin(self, request: dict[str, Any], fds: Sequence[int]) -> RemoteCell:
        """Send the request, read up to the cell's start; an error reply is raised as the host said it."""
        try:
            wire.send(self._sock, request, list(fds))
        except OSError:
            pass  # the host has ended: it says why below (or nothing: it ended before the cell started)
        except wire.WireError as e:
            self.close()
            raise AgentcellError("argv", str(e), "pass a shorter command line") from None
        going = False  # the host is letting the command go: from then on it may have run, and is never run again
        while True:
            msg = self._next(None)
            if msg is None and going:
                return self  # lost (:attr:`lost`): its result says so
            if msg is None:
                self.close()
                raise HostUnavailable("cell", "the cell's host ended before the cell started")
            if msg.get("event") == "going":
                going, self.cell_id = True, str(msg.get("cell_id") or "")
                continue
            if msg.get("event") == "error" and going:
                # (its proxy or its monitor failed once the command was let go: it may have run, so this is
                # its end, said as the host said it, never an error its caller may start it again after)
                err = wire.error_from(msg)
                self.close()
                self._result = {"exit_status": err.exit_code, "signal": None, "error": err.line(),
                                "events": list(self._events), "host_ended": True, "cell_id": self.cell_id}
                if self.surface is not None and not self.supervised:  # (a cell host checks its own)
                    self.surface.check(self._result, self.cell_id)
                return self
            if msg.get("event") == "error":
                self.close()
                raise wire.error_from(msg)
            if msg.get("event") == "started":
                self.cell_id, self.pid1 = str(msg.get("cell_id") or ""), int(msg.get("pid1") or 0)
                return self
            self._take(msg)

    def fileno(self) -> int:
        return self._sock.fileno()

    # ---- the connection --------------------------------------------------------------------------------

    def _next(self, timeout: float | None) -> dict[str, Any] | None:
        if self._eof or not select.select([self._sock], [], [], timeout)[0]:
            return None
        msg, fds = wire.recv_or_gone(self._sock)
        for fd in fds:
            os.close(fd)
        if msg is None:
            self._eof = True
        return msg

    def _take(self, msg: dict[str, Any]) -> None:
        event = msg.get("event")
        if event in ("escape", "note"):
            self._events.append(msg["data"])
        elif event == "stats":
            self._stats = msg["stats"]
        elif event == self._last:
            self._result = dict(msg["result"])
            if self.surface is not None and not self.supervised:
                self.surface.check(self._result, self.cell_id)

    def _drain(self, timeout: float | None = 0) -> None:
        while self._result is None:
            msg = self._next(timeout)
            if msg is None:
                return
            self._take(msg)
            timeout = 0 if timeout is not None else None

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            wire.send(self._sock, msg)
        except OSError:
            pass  # the host has ended: its last word is on the connection

    # ---- the handle --------------------------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        self._drain()
        return list(self._events)

    def stats(self) -> dict[str, Any]:
        self._drain()
        return dict(self._stats)

    @property
    def lost(self) -> bool:
        """The host ended without reporting the cell's end (its cell dies with it: PID 1's parent-death
        signal)."""
        self._drain()
        return self._result is None and self._eof

    def poll(self) -> dict[str, Any] | None:
        """The result once the cell has ended, else None (also when its host was lost: see :attr:`lost`)."""
        self._drain()
        if self._result is not None:
            if self.timed_out:
                self._result.update(exit_status=EXIT_TIMEOUT, signal=SIGKILL, timed_out=True)
            self.close()
        return self._result

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """The result; at ``timeout`` seconds the command is killed and its status is 124. A host lost
        before it reported the end gives ``exit_status`` None and says so in ``error`` (:attr:`was_lost`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (result := self.poll()) is None:
            if self.lost:
                self.was_lost = True
                self._result = {"exit_status": None, "signal": None, "error": "the cell's host ended unexpectedly",
                                "events": list(self._events)}
                self.close()
                if self.surface is not None:  # the cell died with its host; what it planted is still there
                    self.surface.check(self._result, self.cell_id)
                return self._result
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.timed_out, deadline = True, None
                self.signal(SIGKILL)
                continue
            self._drain(left)
        return result

    def settle(self, timeout: float) -> None:
        self._drain(timeout)

    def signal(self, sig: int) -> None:
        """Forwarded to the command (a cell host's ``run``) or the cell (a launcher's ``spawn``)."""
        if self._result is None:
            self._send({"op": "signal", "id": 1, "sig": int(sig)})

    def terminate(self, reason: str) -> None:
        """A supervised cell is frozen, then killed, for ``reason`` (as its monitor would); a launcher's
        plain cell is killed."""
        if self.supervised:
            self._send({"op": "terminate", "reason": reason})
        else:
            self.signal(SIGKILL)

    def close(self) -> None:
        """Let go of the connection: a cell still running is ended by its host (its client has gone)."""
        if not self._eof:
            self._eof = True
            self._sock.close()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.wait()


class RemoteHost:
    """Cells served by processes of ours. ``launcher``: ``"private"`` (a launcher started for this host on
    first use, and stopped by :meth:`close`), ``"warm"`` (the user's ``agentcell warm`` launcher; a
    :class:`HostUnavailable` when none runs, and nothing ran) or ``None`` (a cell host started per cell:
    plain cells need a launcher)."""

    def __init__(self, launcher: str | None = "private", *, prewarm: bool = True) -> None:
        if launcher not in ("private", "warm", None):
            raise ValueError(f"launcher: {launcher!r} is not private, warm or None")
        self.launcher, self.prewarm = launcher, prewarm
        self._control: _socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._open: list[RemoteCell] = []  # the cells of this host's connections, closed with it
        self._lock = _thread.allocate_lock()

    # ---- connections ---------------------------------------------------------------------------------

    def _connection(self) -> _socket.socket:
        """A new connection to our launcher: the user's warm one, or our private one (started the first
        time) through its control socket."""
        if self.launcher == "warm":
            s = connect_warm()
            if s is None:
                raise HostUnavailable("warm", "no warm launcher of yours runs", "start one: agentcell warm start")
            return s
        with self._lock:
            if self._control is None:
                ours, theirs = _pair()
                try:
                    args = ("--conn", str(theirs.fileno()), *([] if self.prewarm else ["--no-prewarm"]))
                    self._proc = _popen(interp.launcher(*args), (_DEVNULL, None, None),
                                        [theirs.fileno()])
                except BaseException:
                    ours.close()
                    raise
                finally:
                    theirs.close()
                self._control = ours
            mine, its = _pair()
            try:
                wire.send(self._control, {"op": "attach"}, [its.fileno()])
            except OSError:
                mine.close()
                raise HostUnavailable("launcher", "the warm launcher process died") from None
            finally:
                its.close()
            return mine

    def _track(self, cell: RemoteCell) -> RemoteCell:
        with self._lock:
            self._open = [c for c in self._open if not c._eof]
            self._open.append(cell)
        return cell

    # ---- the CellHost interface -----------------------------------------------------------------------

    def start(self, spec: CellSpec, argv: Sequence[str], *, stdio: Sequence[int] = (0, 1, 2),
              monitor: str | None = None, options: StartOptions | None = None) -> RemoteCell:
        """``argv`` in a new cell for ``spec``, on the fds ``stdio`` (ours are not closed). ``monitor``
        (its verdict, or None) and what else lives beside the cell choose the op (see the module)."""
        args = [os.fspath(a) for a in argv]
        if not supervised(spec, monitor) and (options is None or not options.beside()):
            if self.launcher is None:
                raise ValueError("a plain cell is a launcher's: RemoteHost('private') or RemoteHost('warm')")
            cell = self._track(RemoteCell(self._connection(), None, False))
            cell.surface = _surface(spec, options)  # a launcher's cell has nothing beside it: the step is ours
            return cell._begin({"op": "spawn", "id": 1, "spec": spec_to_dict(spec), "argv": args}, stdio)
        request: dict[str, Any] = {"op": "run", "spec": spec_to_dict(spec), "argv": args, "monitor": monitor,
                                   "guard": False}
        extra: list[int] = []
        if options is not None:
            request.update(options.wire())
            extra = options.fds()
        if self.launcher is not None and not extra:  # the launcher forks the cell's host, on these stdio
            cell = self._track(RemoteCell(self._connection(), None, True))
            cell.surface = _surface(spec, options)
            return cell._begin(request, stdio)
        ours, theirs = _pair()
        try:
            proc = _popen(interp.host("--conn", str(theirs.fileno())), stdio, (theirs.fileno(), *extra), False)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        cell = RemoteCell(ours, proc, True)
        return cell._begin(request, extra)

    def open(self, spec: CellSpec, *, monitor: str | None = "terminate") -> RemoteLive:
        """A live cell of its own cell host, tied to this process (its end ends the cell)."""
        from .liveclient import RemoteLive

        ours, theirs = _pair()
        try:
            # Not our stdout: it may be a protocol's channel (agentcell mcp).
            proc = _popen(interp.host("--conn", str(theirs.fileno())), (_DEVNULL, _DEVNULL, None),
                          [theirs.fileno()])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        try:
            return RemoteLive.handshake(ours, proc, spec, monitor)
        except BaseException:
            ours.close()
            proc.wait()
            raise

    @staticmethod
    def open_named(spec: CellSpec, monitor: str | None, path: str, name: str, idle_s: float) -> tuple[RemoteLive, int]:
        """A live cell whose host outlives us (``agentcell cell start``): it listens at ``path`` for clients of
        our uid, and leaves after ``stop`` or ``idle_s`` seconds without a command. (The cell, the host's pid.)"""
        from .liveclient import RemoteLive

        proc = serve_detached(path, lambda fd: interp.host("--listen", str(fd), "--path", path, "--name",
                                                                   name, "--idle", str(idle_s)), 16)
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
        s.connect(path)
        try:
            return RemoteLive.handshake(s, None, spec, monitor), proc.pid
        except AgentcellError:
            os.waitpid(proc.pid, 0)  # it refused the cell and leaves: ours to reap
            raise
        except BaseException:  # ended before the cell was handed over (SIGTERM, ^C): the host takes it down
            s.close()
            os.kill(proc.pid, SIGTERM)  # (not proc.terminate(): Popen counts it as gone already)
            os.waitpid(proc.pid, 0)
            raise

    def close(self) -> None:
        """End every cell started here and stop a private launcher. Each cell's end is read before its
        connection goes: a plain cell's protected-path step is this client's, taken when its end comes
        (what a command still running planted on the control surface is moved aside all the same)."""
        with self._lock:
            cells, self._open = self._open, []
        for cell in cells:
            if cell.poll() is None and not cell.lost:
                cell.terminate("its Cell was closed")
                cell.wait(CLOSE_GRACE_S)  # (then killed; its end still read)
            cell.close()
        control, proc, self._control, self._proc = self._control, self._proc, None, None
        if control is not None:
            control.close()
        if proc is not None:
            proc.wait()


_DEVNULL = -3  # subprocess.DEVNULL, without importing subprocess on the warm path
