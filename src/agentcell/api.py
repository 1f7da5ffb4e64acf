"""``agentcell.Cell``: launch commands in cells from a Python program.

Safe in long-lived, multi-threaded programs: this module never forks. A cell comes from a
:class:`~agentcell.host.base.CellHost`: by default a :class:`~agentcell.host.remote.RemoteHost` whose
single-threaded launcher (:mod:`agentcell.host.zygote`) is started with ``subprocess`` (fork+exec) on
first use; every later launch is one request to it. ``Cell(spec, host=FakeHost(...))`` runs on a host
with no kernel behind it, for tests of what is built on top.

``Cell.open(policy)`` gives a :class:`LiveCell` instead: one cell that stays up, watched and behind
its proxy, running many commands (its host is :mod:`agentcell.host.server`, out of this process).
"""
from __future__ import annotations

import os
import queue
import selectors
import signal as _signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .cell.spec import CellSpec
from .errors import EXIT_TIMEOUT, AgentcellError, LaunchError
from .host.base import CellEnded, CellHandle, CellHost, LiveHandle, StartOptions

__all__ = ["Cell", "CellCompleted", "CellEnded", "CellProcess", "LiveCell", "LiveProcess"]

LINGER_S = 0.25  # output read after a live command's end, for what it left running
POLL_S = 0.05  # how often a live command's reader looks whether it has ended


class _CompilesToSpec(Protocol):
    def to_cell_spec(self) -> CellSpec: ...


def _spec(policy: CellSpec | _CompilesToSpec) -> CellSpec:
    return policy if isinstance(policy, CellSpec) else policy.to_cell_spec()


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


class _Process:
    """What a command's handle does alike in a fresh cell and in a live one: ``send_signal`` and the
    two signals named, until its end has been taken."""

    _result: dict[str, Any] | None

    def send_signal(self, sig: int) -> None:
        raise NotImplementedError

    def terminate(self) -> None:
        self.send_signal(_signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(_signal.SIGKILL)


class CellProcess(_Process):
    """A command running in its own cell (from :meth:`Cell.spawn`)."""

    def __init__(self, cell: CellHandle, args: list[str]) -> None:
        self.cell, self.args = cell, args
        self._result: dict[str, Any] | None = None

    @property
    def id(self) -> str:
        return self.cell.cell_id

    def send_signal(self, sig: int) -> None:
        if self._result is None:
            self.cell.signal(int(sig))

    def poll(self) -> int | None:
        if self._result is None:
            self._take(self.cell.poll())
        return None if self._result is None else self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command; on ``timeout`` the command is killed and 124 returned."""
        if self._result is None:
            self._take(self.cell.wait(timeout))
        return self.returncode

    def _take(self, result: dict[str, Any] | None) -> None:
        if result is not None and result.get("exit_status") is None:
            raise LaunchError("launcher", "the warm launcher process died")
        self._result = result

    @property
    def timed_out(self) -> bool:
        return bool(self._result and self._result.get("timed_out"))

    @property
    def returncode(self) -> int:
        assert self._result is not None
        return EXIT_TIMEOUT if self._result.get("timed_out") else int(self._result["exit_status"])

    @property
    def result(self) -> dict[str, Any]:
        assert self._result is not None
        return dict(self._result)


class Cell:
    """A policy and a host. ``Cell(spec).run(["make", "test"])`` runs in a fresh cell each call;
    ``with Cell.open(spec) as cell: cell.exec([...])`` runs many commands in one live cell. A spec with a
    proxy or a host-firewall table runs beside them, in a cell host the launcher forks for it."""

    @staticmethod
    def open(policy: CellSpec | _CompilesToSpec, *, monitor: str | None = "terminate",
             host: CellHost | None = None) -> LiveCell:
        """One live cell for ``policy``: its namespaces, mounts, Landlock domain, monitor (``monitor``:
        terminate, record, ``CLASS=VERDICT,...`` or None) and proxy are made once and shared by every
        :meth:`LiveCell.exec`. An escape under ``terminate`` ends the cell for every caller."""
        return LiveCell.open(_spec(policy), monitor=monitor, host=host)

    def __init__(self, policy: CellSpec | _CompilesToSpec, *, prewarm: bool = True,
                 host: CellHost | None = None) -> None:
        from .host.remote import RemoteHost

        self.spec = _spec(policy)
        if self.spec.cell_id:  # every cell gets an id of its own (its cgroup, its records)
            self.spec = self.spec.replace(cell_id="")
        self.prewarm = prewarm
        self.host: CellHost = host if host is not None else RemoteHost("private", prewarm=prewarm)
        self.closed = False

    def close(self) -> None:
        """End the cells still running (each with its protected-path step) and stop the host's launcher."""
        self.closed = True
        self.host.close()

    def __enter__(self) -> Cell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- launching ------------------------------------------------------------------------------
    def spawn(self, argv: Sequence[str], *, stdin: int | None = None, stdout: int | None = None,
              stderr: int | None = None) -> CellProcess:
        """Start ``argv`` in a new cell. stdio are fds (default: this process's own 0, 1, 2). A
        terminal never reaches a cell: stdin from one becomes /dev/null, output to one goes through a
        pipe copied to it here."""
        args = [os.fspath(a) for a in argv]
        if not args:
            raise AgentcellError("argv", "no command given", "pass e.g. ['make', 'test']")
        if self.closed:
            raise AgentcellError("cell", "this Cell is closed", "make a new Cell")
        fds = [0 if stdin is None else stdin, 1 if stdout is None else stdout, 2 if stderr is None else stderr]
        fds, ours = _without_terminals(fds)
        try:
            # The protected-path step on every path: what a command plants on the control surface of
            # its writable paths (a hook, a harness's config) is moved aside when it ends.
            cell = self.host.start(self.spec, args, stdio=fds, monitor="terminate" if self.spec.watch else None,
                                   options=StartOptions(guard=True))
        finally:
            for fd in ours:
                os.close(fd)
        return CellProcess(cell, args)

    def run(self, argv: Sequence[str], *, input: bytes | str | None = None, timeout: float | None = None,
            capture_output: bool = True, text: bool = False) -> CellCompleted:
        """Run ``argv`` in a new cell and wait, like ``subprocess.run``."""
        start = time.monotonic()
        proc, in_w, out_r, err_r = _piped(lambda i, o, e: self.spawn(argv, stdin=i, stdout=o, stderr=e), input,
                                          capture_output)
        out, err = _communicate(in_w, out_r, err_r, _bytes(input), None if timeout is None else start + timeout)
        if timeout is not None and time.monotonic() - start >= timeout and proc.poll() is None:
            proc.wait(0)  # kills it: its status is 124
        proc.wait()
        res = proc.result
        return CellCompleted(
            args=proc.args, returncode=proc.returncode, **_outputs(out, err, capture_output, text),
            signal=int(res.get("signal") or 0), duration_s=float(res.get("duration_s") or 0.0),
            cell_id=str(res.get("cell_id") or proc.cell.cell_id), timed_out=bool(res.get("timed_out")),
            error=res.get("error"),
        )


class LiveProcess(_Process):
    """A command running in a live cell (from :meth:`LiveCell.spawn`)."""

    def __init__(self, cell: LiveCell, cid: int, args: list[str], waiting: queue.SimpleQueue[dict[str, Any]]) -> None:
        self._cell, self.id, self.args, self._waiting = cell, cid, args, waiting
        self._result: dict[str, Any] | None = None

    def send_signal(self, sig: int) -> None:
        if self._result is None:
            self._cell.live.signal(self.id, int(sig))

    def poll(self) -> int | None:
        if self._result is None:
            try:
                self._take(self._waiting.get_nowait())
            except queue.Empty:
                return None
        return self.returncode

    def _ended_within(self, timeout: float | None) -> bool:
        try:
            self._take(self._waiting.get(timeout=timeout))
        except queue.Empty:
            return False
        return True

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command; on ``timeout`` it (its process group) is killed and 124 returned."""
        if self._result is None and not self._ended_within(timeout):
            self.kill()
            self._ended_within(None)
            self._result = dict(self._result or {}, exit_status=EXIT_TIMEOUT, timed_out=True)
        return self.returncode

    def _take(self, ev: dict[str, Any]) -> None:
        live = self._cell.live
        if ev.get("event") == "error":  # the host refused the request (it never ran)
            from .host.wire import error_from

            live.forget(self.id)
            raise error_from(ev)
        if ev.get("event") == "lost":
            ev = {"event": "exit", "exit_status": 137, "signal": 9, "timed_out": False, "duration_s": 0.0,
                  "ended": live.ended or "the cell's host died"}
        self._result = ev
        live.forget(self.id)

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

    def __init__(self, live: LiveHandle) -> None:
        self.live = live
        self.cell_id, self.pid1 = live.cell_id, live.pid1

    @classmethod
    def open(cls, spec: CellSpec, *, monitor: str | None = "terminate", host: CellHost | None = None) -> LiveCell:
        from .host.remote import RemoteHost

        return cls((host if host is not None else RemoteHost(None)).open(spec, monitor=monitor))

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.live.events()

    @property
    def ended(self) -> str | None:
        return self.live.ended

    @property
    def result(self) -> dict[str, Any] | None:
        return self.live.result

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
        try:
            cid, waiting = self.live.exec(args, fds, env=dict(env or {}), cwd=cwd, timeout=timeout)
        finally:
            for fd in ours:
                os.close(fd)
        return LiveProcess(self, cid, args, waiting)

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
        if res.get("not_started") and capture_output:  # (why, as a shell says it on the command's stderr)
            err += f"{res['not_started']}\n".encode(errors="replace")
        ended = res.get("ended")
        return CellCompleted(
            args=proc.args, returncode=proc.returncode, **_outputs(out, err, capture_output, text),
            signal=int(res.get("signal") or 0), duration_s=float(res.get("duration_s") or 0.0), cell_id=self.cell_id,
            timed_out=bool(res.get("timed_out")), error=f"the cell ended: {ended}" if ended else None,
        )

    def close(self, timeout: float | None = 30.0) -> dict[str, Any] | None:
        """End the cell (commands still running are killed) and return its result: exit, events,
        egress refusals, as ``agentcell run --json`` gives them."""
        return self.live.close(timeout)

    def __enter__(self) -> LiveCell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_H = TypeVar("_H", CellProcess, LiveProcess)


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
