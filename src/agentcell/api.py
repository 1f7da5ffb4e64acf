"""``agentcell.Cell``: launch commands in cells from a Python program.

Safe in long-lived, multi-threaded programs: this module never forks. The first launch starts a
single-threaded warm launcher (:mod:`agentcell.cell.zygote`) with ``subprocess`` (fork+exec), and
every later launch is one request to it. One reader thread dispatches its replies.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .cell import wire, zygote
from .cell.spec import CellSpec, spec_to_dict
from .errors import EXIT_TIMEOUT, AgentcellError, LaunchError


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


class CellProcess:
    """A command running in its own cell (from :meth:`Cell.spawn`)."""

    def __init__(self, cell: Cell, rid: int, args: list[str], pending: _Pending) -> None:
        self._cell, self.id, self.args, self._pending = cell, rid, args, pending
        self._result: dict[str, Any] | None = None
        self.timed_out = False

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

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command; on ``timeout`` the whole cell is killed and 124 returned."""
        if self._result is None:
            try:
                self._take(self._pending.events.get(timeout=timeout))
            except queue.Empty:
                self.timed_out = True
                self.kill()
                self._take(self._pending.events.get())
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
    """A policy and a warm launcher. ``Cell(spec).run(["make", "test"])`` runs in a fresh cell each call."""

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
        in_r, in_w = os.pipe2(os.O_CLOEXEC) if input is not None else (os.open(os.devnull, os.O_RDONLY), -1)
        pipes = [os.pipe2(os.O_CLOEXEC) if capture_output else (-1, 1), None]
        pipes[1] = os.pipe2(os.O_CLOEXEC) if capture_output else (-1, 2)
        (out_r, out_w), (err_r, err_w) = pipes  # type: ignore[misc]
        try:
            proc = self.spawn(argv, stdin=in_r, stdout=out_w, stderr=err_w)
        finally:
            os.close(in_r)
            if capture_output:
                os.close(out_w)
                os.close(err_w)
        data = input.encode() if isinstance(input, str) else input
        out, err = _communicate(in_w, out_r, err_r, data, None if timeout is None else start + timeout)
        timed_out = timeout is not None and time.monotonic() - start >= timeout and proc.poll() is None
        if timed_out:
            proc.timed_out = True
            proc.kill()
        proc.wait()
        res = proc.result

        def conv(b: bytes) -> bytes | str:
            return b.decode(errors="replace") if text else b

        return CellCompleted(
            args=proc.args, returncode=proc.returncode,
            stdout=conv(out) if capture_output else None, stderr=conv(err) if capture_output else None,
            signal=int(res["signal"]), duration_s=float(res["duration_s"]), cell_id=str(res["cell_id"]),
            timed_out=bool(res["timed_out"]), error=res.get("error"),
        )


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


def _communicate(in_w: int, out_r: int, err_r: int, data: bytes | None,
                 deadline: float | None) -> tuple[bytes, bytes]:
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
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
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
