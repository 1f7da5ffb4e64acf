"""The one place the session starts a cell: :class:`agentcell.supervise.Supervised` (the cell with its
proxy, host-firewall table and escape monitor, verdict ``terminate``), run in a process of its own (the
cell host, :mod:`agentcell.host.server`, which also hosts live cells) because the graph's process has
LangGraph's worker threads and the launcher must not fork from it. :class:`HostedCell` is the
session's view of that process, with Supervised's interface: ``cell_id``, ``pid1``, ``events()``,
``poll()``, ``wait()``, ``terminate(reason)``, ``stats()``."""
from __future__ import annotations

import os
import select
import socket
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from ..cell.spec import CellSpec, spec_to_dict
from ..errors import LaunchError
from ..host import wire


class HostedCell:
    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self._proc, self._sock = proc, sock
        self._events: list[dict[str, Any]] = []
        self._stats: dict[str, Any] = {}
        self._result: dict[str, Any] | None = None
        self._eof = False
        self.cell_id, self.pid1 = "", 0

    @classmethod
    def start(cls, spec: CellSpec, argv: list[str], *, stdio: Sequence[int] = (0, 1, 2),
              firewall: tuple[Any, Any] | None = None, credentials: Any = None,
              upstream_ca: str | None = None) -> HostedCell:
        """``firewall``: the session's host-firewall table and log reader, handed to the host (which
        removes them with the cell); the caller closes its copy of the reader once this returns.
        ``credentials`` (:class:`agentcell.network.credentials.CredentialSet`): injected by the cell's
        proxy (:meth:`agentcell.supervise.Supervised.start`), handed to the host over the socket."""
        from ..host import server

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Its stdio are the agent's (a terminal is relayed through a pty of the cell's own there).
            proc = subprocess.Popen(server.command("--conn", str(theirs.fileno())), stdin=stdio[0],
                                    stdout=stdio[1], stderr=stdio[2], pass_fds=(theirs.fileno(),), cwd="/",
                                    env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                         "LANG": os.environ.get("LANG", "C.UTF-8")})
        except OSError as e:
            ours.close()
            raise LaunchError("spawn", f"cannot start the cell's host: {e.strerror}") from None
        finally:
            theirs.close()
        cell = cls(proc, ours)
        # A session's account (its own, or a persistent agent's) runs nothing outside its cells; its
        # cleanup checks the protected paths (with the account's details), not the host.
        request: dict[str, Any] = {"op": "run", "spec": spec_to_dict(spec), "argv": list(argv), "monitor": "terminate",
                                   "dedicated": True, "guard": False}  # the environment's secrets: a socket, not argv
        if credentials is not None and credentials.secrets:
            request["credentials"] = credentials.as_wire()
            request["upstream_ca"] = upstream_ca
        fds = []
        if firewall is not None:
            fw, log = firewall
            request["firewall"] = {"table": fw.table, "record": fw.record, "group": log.group}
            fds = [log.sock.fileno()]
        try:
            wire.send(cell._sock, request, fds)
        except OSError:
            pass  # the host has ended: it says why below (or nothing: it ended before the cell started)
        while not cell.pid1:
            msg = cell._next(None)
            if msg is None or msg.get("event") == "error":
                cell.close()
                raise LaunchError("cell", str(msg["message"]) if msg else "the cell's host ended before the cell "
                                  "started")
            if msg.get("event") == "started":
                cell.cell_id, cell.pid1 = str(msg["cell_id"]), int(msg["pid1"])
            else:
                cell._take(msg)
        return cell

    # ---- the host's socket -------------------------------------------------------------------------

    def _send(self, obj: dict[str, Any]) -> None:
        try:
            wire.send(self._sock, obj)
        except OSError:
            pass  # the host has ended: its last word is on the socket

    def _next(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message, waiting up to ``timeout`` (None: until one comes or the host ends)."""
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
        elif event == "ended":
            self._result = msg["result"]

    def _drain(self, timeout: float | None = 0) -> None:
        while self._result is None:
            msg = self._next(timeout)
            if msg is None:
                return
            self._take(msg)
            timeout = 0 if timeout is not None else None

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
        self._send({"op": "terminate", "reason": reason})

    def close(self) -> None:
        if self._proc.returncode is None:
            self._sock.close()
            self._proc.wait()


def start(spec: CellSpec, argv: list[str], *, stdio: Sequence[int] = (0, 1, 2),
          firewall: tuple[Any, Any] | None = None, credentials: Any = None,
          upstream_ca: str | None = None) -> HostedCell:
    return HostedCell.start(spec, argv, stdio=stdio, firewall=firewall, credentials=credentials,
                            upstream_ca=upstream_ca)
