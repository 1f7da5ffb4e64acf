"""``agentcell.Cell``: launch commands in cells from a Python program.

Safe in long-lived, multi-threaded programs: this module never forks. The first launch starts a
single-threaded warm launcher (:mod:`agentcell.host.zygote`) with ``subprocess`` (fork+exec), and
every later launch is one request to it. One reader thread dispatches its replies.

``Cell.open(policy)`` gives a :class:`LiveCell` instead: one cell that stays up, watched and behind
its proxy, running many commands (:mod:`agentcell.host.server` hosts it, out of this process).
"""
from __future__ import annotations

import os
import queue
import selectors
import signal as _signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from .cell.spec import CellSpec, spec_to_dict
from .errors import EXIT_TIMEOUT, AgentcellError, LaunchError
from .host import wire, zygote

LINGER_S = 0.25  # output read after a live command's end, for what it left running
POLL_S = 0.05  # how often a live command's reader looks whether it has ended


class _CompilesToSpec(Protocol):
    def to_cell_spec(self) -> CellSpec: ...


@dataclass
class CellCompleted:
    """Like ``subprocess.CompletedProcess``, plus what the cell saw."""

    args: list[str]
    returncode: int
    stdout: bytes | str | None
    stderr: bytes | str | None
    signal: int = 0
    duration_s: float = 0.0
    cell_id: str = ""
    timed_out: bool = False
    error: str | None = None

    def check_returncode(self) -> None:
        if self.returncode:
            raise subprocess.CalledProcessError(self.returncode, self.args, self.stdout, self.stderr)


@dataclass
class _Pending:
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)


class _Handle:
    """What a command's handle does alike in a fresh cell and in a live one: signals go out as
    requests, its end comes from the queue its cell's reader fills (``_take`` reads that message)."""

    def __init__(self, cell: Any, rid: int, args: list[str], pending: _Pending) -> None:
        self._cell, self.id, self.args, self._pending = cell, rid, args, pending
        self._result: dict[str, Any] | None = None

    def send_signal(self, sig: int) -> None:
        if self._result is None:
            self._cell._send({"op": "signal", "id": self.id, "sig": int(sig)})

    def terminate(self) -> None:
        self.send_signal(_signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(_signal.SIGKILL)

    def poll(self) -> int | None:
        if self._result is None:
            try:
                self._take(self._pending.events.get_nowait())
            except queue.Empty:
                return None
        return self.returncode

    def _ended_within(self, timeout: float | None) -> bool:
        """Take its end if it comes within ``timeout``; False if it did not."""
        try:
            self._take(self._pending.events.get(timeout=timeout))
        except queue.Empty:
            return False
        return True

    def _take(self, ev: dict[str, Any]) -> None:
        raise NotImplementedError

    @property
    def returncode(self) -> int:
        raise NotImplementedError


class CellProcess(_Handle):
    """A command running in its own cell (from :meth:`Cell.spawn`)."""

    def __init__(self, cell: Cell, rid: int, args: list[str], pending: _Pending) -> None:
        super().__init__(cell, rid, args, pending)
        self.timed_out = False

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command; on ``timeout`` the whole cell is killed and 124 returned."""
        if self._result is None and not self._ended_within(timeout):
            self.timed_out = True
            self.kill()
            self._ended_within(None)
        return self.returncode

    def _take(self, ev: dict[str, Any]) -> None:
        if ev.get("event") == "lost":
            raise LaunchError("launcher", "the warm launcher process died")
        self._result = ev["result"]
        self._cell._forget(self.id)

    @property
    def returncode(self) -> int:
        assert self._result is not None
        return EXIT_TIMEOUT if self.timed_out else int(self._result["exit_status"])

    @property
    def result(self) -> dict[str, Any]:
        assert self._result is not None
        return dict(self._result, timed_out=self.timed_out or self._result["timed_out"])


class Cell:
    """A policy and a warm launcher. ``Cell(spec).run(["make", "test"])`` runs in a fresh cell each call;
    ``with Cell.open(spec) as cell: cell.exec([...])`` runs many commands in one live cell."""

    @staticmethod
    def open(policy: CellSpec | _CompilesToSpec, *, monitor: str | None = "terminate") -> LiveCell:
        """One live cell for ``policy``: its namespaces, mounts, Landlock domain, monitor (``monitor``:
        terminate, record, ``CLASS=VERDICT,...`` or None) and proxy are made once and shared by every
        :meth:`LiveCell.exec`. An escape under ``terminate`` ends the cell for every caller."""
        return LiveCell.open(policy if isinstance(policy, CellSpec) else policy.to_cell_spec(), monitor=monitor)

    def __init__(self, policy: CellSpec | _CompilesToSpec, *, prewarm: bool = True) -> None:
        self.spec = policy if isinstance(policy, CellSpec) else policy.to_cell_spec()
        self.prewarm = prewarm
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending: dict[int, _Pending] = {}
        self._next = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def _ensure(self) -> socket.socket:
        with self._lock:
            if self._sock is None:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                with theirs:
                    self._proc = subprocess.Popen(
                        zygote.launcher_command("--conn", str(theirs.fileno()),
                                                *([] if self.prewarm else ["--no-prewarm"])),
                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True, cwd="/",
                        start_new_session=True,  # the launcher and its cells never share our terminal
                        env=zygote.launcher_env(),
                    )
                self._sock = ours
                threading.Thread(target=self._reader, args=(ours,), name="agentcell-cell-reader",
                                 daemon=True).start()
            return self._sock

    def close(self) -> None:
        """Stop the warm launcher; cells still running are killed."""
        with self._lock:
            sock, proc, self._sock, self._proc = self._sock, self._proc, None, None
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if proc is not None:
            proc.wait()

    def __enter__(self) -> Cell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._sock is not None:
            self._sock.close()

    def _reader(self, sock: socket.socket) -> None:
        while True:
            try:
                msg, _ = wire.recv(sock)
            except (OSError, wire.WireError):
                msg = None
            if msg is None:
                for p in list(self._pending.values()):
                    p.events.put({"event": "lost"})
                return
            waiting = self._pending.get(int(msg["id"]))
            if waiting is not None:
                waiting.events.put(msg)

    def _send(self, msg: dict[str, object], fds: list[int] | None = None) -> None:
        wire.send(self._ensure(), msg, fds)

    def _forget(self, rid: int) -> None:
        self._pending.pop(rid, None)

    # -- launching ------------------------------------------------------------------------------
    def spawn(self, argv: Sequence[str], *, stdin: int | None = None, stdout: int | None = None,
              stderr: int | None = None) -> CellProcess:
        """Start ``argv`` in a new cell. stdio are fds (default: this process's own 0, 1, 2). A
        terminal never reaches a cell: stdin from one becomes /dev/null, output to one goes through a
        pipe copied to it here."""
        args = [os.fspath(a) for a in argv]
        if not args:
            raise AgentcellError("argv", "no command given", "pass e.g. ['make', 'test']")
        fds = [0 if stdin is None else stdin, 1 if stdout is None else stdout, 2 if stderr is None else stderr]
        fds, ours = _without_terminals(fds)
        with self._lock:
            self._next += 1
            rid = self._next
            pending = self._pending[rid] = _Pending()
        try:
            self._send({"op": "spawn", "id": rid, "spec": spec_to_dict(self.spec), "argv": args}, fds)
        finally:
            for fd in ours:
                os.close(fd)
        ev = pending.events.get()
        if ev["event"] == "error":
            self._forget(rid)
            err = AgentcellError(str(ev["field"]), str(ev["message"]))
            err.exit_code = int(ev["code"])
            raise err
        if ev["event"] == "lost":
            raise LaunchError("launcher", "the warm launcher process died")
        return CellProcess(self, rid, args, pending)

    def run(self, argv: Sequence[str], *, input: bytes | str | None = None, timeout: float | None = None,
            capture_output: bool = True, text: bool = False) -> CellCompleted:
        """Run ``argv`` in a new cell and wait, like ``subprocess.run``."""
        start = time.monotonic()
        proc, in_w, out_r, err_r = _piped(lambda i, o, e: self.spawn(argv, stdin=i, stdout=o, stderr=e), input,
                                          capture_output)
        out, err = _communicate(in_w, out_r, err_r, _bytes(input), None if timeout is None else start + timeout)
        timed_out = timeout is not None and time.monotonic() - start >= timeout and proc.poll() is None
        if timed_out:
            proc.timed_out = True
            proc.kill()
        proc.wait()
        res = proc.result
        return CellCompleted(
            args=proc.args, returncode=proc.returncode, **_outputs(out, err, capture_output, text),
            signal=int(res["signal"]), duration_s=float(res["duration_s"]), cell_id=str(res["cell_id"]),
            timed_out=bool(res["timed_out"]), error=res.get("error"),
        )


class CellEnded(AgentcellError):
    """The live cell has ended (an escape, a stop, its host gone); ``reason`` says which."""

    exit_code = 137

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__("cell", reason, "open a new cell")


class LiveProcess(_Handle):
    """A command running in a live cell (from :meth:`LiveCell.spawn`)."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command; on ``timeout`` it (its process group) is killed and 124 returned."""
        if self._result is None and not self._ended_within(timeout):
            self.kill()
            self._ended_within(None)
            self._result = dict(self._result or {}, exit_status=EXIT_TIMEOUT, timed_out=True)
        return self.returncode

    def _take(self, ev: dict[str, Any]) -> None:
        if ev.get("event") == "error":  # the host refused the request (it never ran)
            self._cell._forget(self.id)
            err = AgentcellError(str(ev["field"]), str(ev["message"]).removeprefix(f"{ev['field']}: "))
            err.exit_code = int(ev.get("code") or 125)
            raise err
        if ev.get("event") == "lost":
            ev = {"event": "exit", "exit_status": 137, "signal": 9, "timed_out": False, "duration_s": 0.0,
                  "ended": self._cell.ended or "the cell's host died"}
        self._result = ev
        self._cell._forget(self.id)

    @property
    def returncode(self) -> int:
        assert self._result is not None
        return int(self._result["exit_status"])

    @property
    def result(self) -> dict[str, Any]:
        assert self._result is not None
        return dict(self._result)


class LiveCell:
    """One cell that stays up and runs many commands (:meth:`Cell.open`). Thread-safe: commands may
    run at once from several threads. ``events`` lists what the monitor saw; ``ended`` says why the
    cell ended (None while it runs); :meth:`close` ends it and returns its result."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes] | None, cell_id: str, pid1: int) -> None:
        self._sock, self._proc, self.cell_id, self.pid1 = sock, proc, cell_id, pid1
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next = 0
        self.events: list[dict[str, Any]] = []
        self.ended: str | None = None
        self.result: dict[str, Any] | None = None
        self._done = threading.Event()
        threading.Thread(target=self._reader, name="agentcell-live-reader", daemon=True).start()

    @classmethod
    def open(cls, spec: CellSpec, *, monitor: str | None = "terminate") -> LiveCell:
        from .host import server

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            # Not our stdout: it may be a protocol's channel (agentcell mcp).
            proc = subprocess.Popen(server.command("--conn", str(theirs.fileno())), pass_fds=[theirs.fileno()],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True, cwd="/",
                                    start_new_session=True,
                                    env=zygote.launcher_env())
        try:
            return cls._handshake(ours, proc, spec, monitor)
        except BaseException:
            ours.close()
            proc.wait()
            raise

    @classmethod
    def connect(cls, sock: socket.socket) -> LiveCell:
        """A client of a named cell's host (``agentcell cell``), already open."""
        wire.send(sock, {"op": "status"})
        msg, _ = wire.recv(sock)
        if msg is None or msg.get("event") != "status":
            raise CellEnded("the cell's host did not answer")
        if msg.get("ended"):
            raise CellEnded(str(msg["ended"]))
        return cls(sock, None, str(msg["cell_id"]), int(msg["pid1"]))

    @classmethod
    def _handshake(cls, sock: socket.socket, proc: subprocess.Popen[bytes] | None, spec: CellSpec,
                   monitor: str | None) -> LiveCell:
        from .protect.check import human

        wire.send(sock, {"op": "open", "spec": spec_to_dict(spec), "monitor": monitor, "give_to": human()})
        msg, _ = wire.recv(sock)
        if msg is None:
            raise LaunchError("cell", "the cell's host ended before the cell started")
        if msg.get("event") == "error":
            err = AgentcellError(str(msg["field"]), str(msg["message"]).removeprefix(f"{msg['field']}: "))
            err.exit_code = int(msg["code"])
            raise err
        return cls(sock, proc, str(msg["cell_id"]), int(msg["pid1"]))

    def _reader(self) -> None:
        while True:
            msg, fds = wire.recv_or_gone(self._sock)
            for fd in fds:
                os.close(fd)
            if msg is None or msg.get("event") == "ended":
                if msg is not None:
                    self.result = msg.get("result")
                self.ended = str(msg["reason"]) if msg is not None else self.ended or "the cell's host died"
                with self._lock:
                    waiting = list(self._pending.values())
                for p in waiting:
                    p.events.put({"event": "lost"})
                self._done.set()
                if msg is None:
                    return
                continue
            if msg.get("event") in ("escape", "note"):
                self.events.append(msg["data"])
                continue
            cid = msg.get("id")
            if msg.get("event") == "exit" and msg.get("ended") and self.ended is None:
                # The cell's end cut this command short: so said before the command's own end is
                # delivered, for whoever looks at the cell once its command has returned.
                self.ended = str(msg["ended"])
            one = self._pending.get(cid) if isinstance(cid, int) else None
            if one is not None and msg.get("event") != "started":
                one.events.put(msg)

    def _send(self, msg: dict[str, object], fds: list[int] | None = None) -> None:
        try:
            wire.send(self._sock, msg, fds)
        except OSError:
            raise CellEnded(self.ended or "the cell's host has gone") from None

    def _forget(self, cid: int) -> None:
        with self._lock:
            self._pending.pop(cid, None)

    def spawn(self, argv: Sequence[str], *, stdin: int | None = None, stdout: int | None = None,
              stderr: int | None = None, env: dict[str, str] | None = None, cwd: str | None = None,
              timeout: float | None = None) -> LiveProcess:
        """Start ``argv`` in the cell (stdio as in :meth:`Cell.spawn`; ``env`` added to the policy's;
        ``timeout``: the cell's host kills it then, status 124). Raises :class:`CellEnded` once the
        cell has ended."""
        if self.ended is not None:
            raise CellEnded(self.ended)
        args = [os.fspath(a) for a in argv]
        if not args:
            raise AgentcellError("argv", "no command given", "pass e.g. ['make', 'test']")
        fds = [0 if stdin is None else stdin, 1 if stdout is None else stdout, 2 if stderr is None else stderr]
        fds, ours = _without_terminals(fds)
        with self._lock:
            self._next += 1
            cid = self._next
            pending = self._pending[cid] = _Pending()
        try:
            self._send({"op": "exec", "id": cid, "argv": args, "env": dict(env or {}), "cwd": cwd,
                        "timeout": timeout}, fds)
        except BaseException:
            self._forget(cid)
            raise
        finally:
            for fd in ours:
                os.close(fd)
        return LiveProcess(self, cid, args, pending)

    def exec(self, argv: Sequence[str], *, input: bytes | str | None = None, timeout: float | None = None,
             env: dict[str, str] | None = None, cwd: str | None = None, capture_output: bool = True,
             text: bool = False) -> CellCompleted:
        """Run ``argv`` in the cell and wait, like ``subprocess.run``. A command the cell's end cut
        short (an escape by any command) returns 137 with ``error`` naming the reason."""
        proc, in_w, out_r, err_r = _piped(
            lambda i, o, e: self.spawn(argv, stdin=i, stdout=o, stderr=e, env=env, cwd=cwd, timeout=timeout),
            input, capture_output)
        # The host enforces the timeout. Once the command has ended its output is read for a moment
        # more, not until EOF: what it left running in the cell (a dev server) may hold the pipes.
        out, err = _communicate(in_w, out_r, err_r, _bytes(input), None, done=lambda: proc.poll() is not None)
        proc.wait()
        res = proc.result
        ended = res.get("ended")
        return CellCompleted(
            args=proc.args, returncode=proc.returncode, **_outputs(out, err, capture_output, text),
            signal=int(res.get("signal") or 0), duration_s=float(res.get("duration_s") or 0.0), cell_id=self.cell_id,
            timed_out=bool(res.get("timed_out")), error=f"the cell ended: {ended}" if ended else None,
        )

    def close(self, timeout: float | None = 30.0) -> dict[str, Any] | None:
        """End the cell (commands still running are killed) and return its result: exit, events,
        egress refusals, as ``agentcell run --json`` gives them."""
        if self.ended is None:
            try:
                wire.send(self._sock, {"op": "stop"})
            except OSError:
                pass
        self._done.wait(timeout)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:  # our own child: its cell dies with it
                self._proc.kill()
                self._proc.wait()
        return self.result

    def __enter__(self) -> LiveCell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_H = TypeVar("_H", bound=_Handle)


def _piped(spawn: Callable[[int, int, int], _H], input: bytes | str | None,
           capture_output: bool) -> tuple[_H, int, int, int]:
    """``spawn(stdin, stdout, stderr)`` with a pipe for what is fed (else /dev/null) and pipes for what
    is captured (else our own 1 and 2); (the handle, input's write end, output's and error's read
    ends, -1 where there is none). Our copies of the command's ends are closed either way."""
    in_r, in_w = os.pipe2(os.O_CLOEXEC) if input is not None else (os.open(os.devnull, os.O_RDONLY), -1)
    out_r, out_w = os.pipe2(os.O_CLOEXEC) if capture_output else (-1, 1)
    err_r, err_w = os.pipe2(os.O_CLOEXEC) if capture_output else (-1, 2)
    try:
        proc = spawn(in_r, out_w, err_w)
    except BaseException:
        for fd in (in_w, out_r, err_r):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        os.close(in_r)
        if capture_output:
            os.close(out_w)
            os.close(err_w)
    return proc, in_w, out_r, err_r


def _bytes(input: bytes | str | None) -> bytes | None:
    return input.encode() if isinstance(input, str) else input


def _outputs(out: bytes, err: bytes, capture_output: bool, text: bool) -> dict[str, bytes | str | None]:
    """A CellCompleted's stdout and stderr: None when not captured, decoded with ``text``."""
    if not capture_output:
        return {"stdout": None, "stderr": None}
    if text:
        return {"stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace")}
    return {"stdout": out, "stderr": err}


def _without_terminals(fds: list[int]) -> tuple[list[int], list[int]]:
    """Replace terminal fds (see :meth:`Cell.spawn`); returns the fds to send and those to close after."""
    out, ours = list(fds), []
    for i, fd in enumerate(fds):
        if not os.isatty(fd):
            continue
        if i == 0:
            out[i] = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        else:
            r, w = os.pipe2(os.O_CLOEXEC)
            threading.Thread(target=_copy_until_eof, args=(r, fd), name="agentcell-output", daemon=True).start()
            out[i] = w
        ours.append(out[i])
    return out, ours


def _copy_until_eof(src: int, dst: int) -> None:
    try:
        while chunk := os.read(src, 65536):
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst, view):]
    except OSError:
        pass
    finally:
        os.close(src)


def _communicate(in_w: int, out_r: int, err_r: int, data: bytes | None, deadline: float | None,
                 done: Callable[[], bool] | None = None) -> tuple[bytes, bytes]:
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    sel = selectors.DefaultSelector()
    for fd in (out_r, err_r):
        if fd >= 0:
            sel.register(fd, selectors.EVENT_READ)
    view = memoryview(data or b"")
    if in_w >= 0:
        if view:
            os.set_blocking(in_w, False)
            sel.register(in_w, selectors.EVENT_WRITE)
        else:
            os.close(in_w)
    try:
        while sel.get_map():
            if done is not None and done():
                done, deadline = None, min(deadline or float("inf"), time.monotonic() + LINGER_S)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if done is not None:
                left = POLL_S if left is None else min(left, POLL_S)
            for key, _ in sel.select(left):
                fd = int(key.fd)
                if fd == in_w:
                    try:
                        n = os.write(fd, view[:65536])
                    except BrokenPipeError:
                        n = len(view)
                    view = view[n:]
                    if not view:
                        sel.unregister(fd)
                        os.close(fd)
                    continue
                chunk = os.read(fd, 65536)
                if chunk:
                    chunks[fd].append(chunk)
                else:
                    sel.unregister(fd)
    finally:
        for key in list(sel.get_map().values()):
            os.close(int(key.fd))
        sel.close()
        for fd in (out_r, err_r):
            try:
                os.close(fd)
            except OSError:
                pass
    return b"".join(chunks.get(out_r, [])), b"".join(chunks.get(err_r, []))
