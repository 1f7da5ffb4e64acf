"""The one place the session starts a cell: :class:`agentcell.supervise.Supervised` (the cell with its
proxy, host-firewall table and escape monitor, verdict ``terminate``), run in a process of its own
(:mod:`.cellhost`) because the graph's process has LangGraph's worker threads and the launcher must not
fork from it. :class:`HostedCell` is the session's view of that process, with Supervised's interface:
``cell_id``, ``pid1``, ``events()``, ``poll()``, ``wait()``, ``terminate(reason)``, ``stats()``."""
from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from ..cell.spec import CellSpec, spec_to_dict
from ..errors import LaunchError
from . import cellhost


class HostedCell:
    def __init__(self, proc: subprocess.Popen[bytes], ctl: int, report: int) -> None:
        self._proc, self._ctl, self._report = proc, ctl, report
        self._buf = b""
        self._events: list[dict[str, Any]] = []
        self._stats: dict[str, Any] = {}
        self._result: dict[str, Any] | None = None
        self._eof = False
        self.cell_id, self.pid1 = "", 0

    @classmethod
    def start(cls, spec: CellSpec, argv: list[str], *, stdio: Sequence[int] = (0, 1, 2)) -> HostedCell:
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
        try:
            proc = subprocess.Popen(cellhost.command(ctl_r, rep_w), stdin=stdio[0], stdout=stdio[1],
                                    stderr=stdio[2], pass_fds=(ctl_r, rep_w), cwd="/",
                                    env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                         "LANG": os.environ.get("LANG", "C.UTF-8")})
        except OSError as e:
            for fd in (ctl_r, ctl_w, rep_r, rep_w):
                os.close(fd)
            raise LaunchError("spawn", f"cannot start the cell's host: {e.strerror}") from None
        os.close(ctl_r)
        os.close(rep_w)
        cell = cls(proc, ctl_w, rep_r)
        cell._send({"spec": spec_to_dict(spec), "argv": list(argv)})  # the environment's secrets: a pipe, not argv
        while not cell.pid1:
            msg = cell._next(None)
            if msg is None or "error" in msg:
                cell.close()
                raise LaunchError("cell", str(msg["error"]) if msg else "the cell's host ended before the cell "
                                  "started")
            if "started" in msg:
                cell.cell_id, cell.pid1 = str(msg["started"]["cell_id"]), int(msg["started"]["pid1"])
            else:
                cell._take(msg)
        return cell

    # ---- the report pipe ---------------------------------------------------------------------------

    def _send(self, obj: dict[str, Any]) -> None:
        data = (json.dumps(obj) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._ctl, data):]
        except BrokenPipeError:
            pass  # the host has ended: its last word is on the report pipe

    def _next(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message, waiting up to ``timeout`` (None: until one comes or the host ends)."""
        while b"\n" not in self._buf:
            if self._eof or not select.select([self._report], [], [], timeout)[0]:
                return None
            chunk = os.read(self._report, 1 << 20)
            if not chunk:
                self._eof = True
                return None
            self._buf += chunk
            timeout = 0 if timeout is not None else None
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        return msg

    def _take(self, msg: dict[str, Any]) -> None:
        if "event" in msg:
            self._events.append(msg["event"])
        elif "stats" in msg:
            self._stats = msg["stats"]
        elif "result" in msg:
            self._result = msg["result"]

    def _drain(self, timeout: float | None = 0) -> None:
        while self._result is None:
            msg = self._next(timeout)
            if msg is None:
                return
            self._take(msg)

    # ---- Supervised's interface --------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        self._drain()
        return list(self._events)

    def stats(self) -> dict[str, Any]:
        self._drain()
        return dict(self._stats)

    @property
    def lost(self) -> bool:
        """The host ended without reporting the cell's end: the session has lost sight of it (its cell
        dies with it: PID 1's parent-death signal)."""
        self._drain()
        return self._result is None and self._eof

    def poll(self) -> dict[str, Any] | None:
        self._drain()
        if self._result is not None:
            self.close()
        return self._result

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if self.lost:
                self._result = {"exit_status": None, "signal": None, "error": "the cell's host ended unexpectedly",
                                "events": list(self._events)}
                self.close()
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.terminate("timeout")
                deadline = None
                continue
            self._drain(left)
        assert self._result is not None
        return self._result

    def terminate(self, reason: str) -> None:
        """Freeze, then kill the cell (Supervised.terminate, in the host)."""
        self._send({"terminate": reason})

    def close(self) -> None:
        if self._proc.returncode is None:
            os.close(self._ctl)
            self._proc.wait()
            os.close(self._report)


def start(spec: CellSpec, argv: list[str], *, stdio: Sequence[int] = (0, 1, 2)) -> HostedCell:
    return HostedCell.start(spec, argv, stdio=stdio)
