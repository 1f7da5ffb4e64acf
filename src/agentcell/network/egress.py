"""Starting a cell's proxy, stopping it, and reading what it refused.

The supervisor (``agentcell run``) gets the listening socket from the cell (made inside the cell's
network namespace, see ``cell/launch.py``), passes it to a proxy process of its own, and kills that
process by PID when the cell has ended. Refusals arrive as JSON lines in an unlinked file (a pipe
could fill up and stall the proxy while nobody reads it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from ..cell.spec import PROXY_PORT, proxy_environment
from ..errors import printable

__all__ = ["PROXY_PORT", "ProxyProcess", "proxy_environment", "summary"]
MAX_READ = 2 << 20  # the proxy writes at most 1 MiB of events


def secrets_memfd(creds: Any, ca: Any, upstream_ca: str | None) -> int:
    """The proxy's credentials (values included) and a leaf per bound host, in a memfd (memory only,
    never a path): read by the proxy at its start and closed. The CA's own key is not in it."""
    config = {"secrets": creds.as_wire(),
              "leaves": {h: [pem.decode() for pem in ca.leaf(h)] for h in creds.hosts()} if ca is not None else {},
              "upstream_ca": upstream_ca}
    fd = os.memfd_create("agentcell-secrets", os.MFD_CLOEXEC)
    try:
        os.write(fd, json.dumps(config).encode())
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ProxyProcess:
    def __init__(self, listen_fd: int, rules: tuple[str, ...], secrets_fd: int | None = None) -> None:
        """``secrets_fd``: :func:`secrets_memfd`'s, given to the proxy (and closed here)."""
        # Held for the proxy's whole life and closed in stop(): no with-block fits.
        self.events_file = tempfile.TemporaryFile(mode="w+b", prefix="agentcell-egress-")  # noqa: SIM115
        self._offset = 0  # how far new_events() has read
        # rung after each event, so the supervisor reads it while the refused client still waits
        self._bell, bell_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        argv = [sys.executable, "-I", "-c", "import sys; from agentcell.network.proxy import main; main(sys.argv[1:])",
                "--listen-fd", str(listen_fd), "--events-fd", str(self.events_file.fileno()),
                "--rules", json.dumps(list(rules)), "--parent", str(os.getpid()), "--bell-fd", str(bell_w)]
        fds: tuple[int, ...] = (listen_fd, self.events_file.fileno(), bell_w)
        if secrets_fd is not None:
            argv += ["--secrets-fd", str(secrets_fd)]
            fds += (secrets_fd,)
        try:
            self.proc = subprocess.Popen(argv, pass_fds=fds, cwd="/",
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except BaseException:
            os.close(self._bell)
            raise
        finally:
            os.close(bell_w)
            if secrets_fd is not None:
                os.close(secrets_fd)
        os.close(listen_fd)  # the proxy holds it now: the cell's way out is that process, nothing else

    def fileno(self) -> int:
        """Readable when the proxy has written events (poll this, then :meth:`new_events`)."""
        return self._bell

    def new_events(self) -> list[dict[str, Any]]:
        """Refusals written since the last call (the monitor's live view of them)."""
        try:
            os.read(self._bell, 4096)
        except OSError:
            pass  # nothing rung (or closed by stop()): the file says what there is
        offset = self._offset
        data = os.pread(self.events_file.fileno(), MAX_READ, offset)
        complete = data[:data.rfind(b"\n") + 1]
        self._offset = offset + len(complete)
        out = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def stop(self) -> list[dict[str, Any]]:
        """End the proxy (it has no work once its cell is gone) and return its refusals."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self._bell)
        self._bell = -1
        self.events_file.seek(0)
        events = []
        for line in self.events_file.read(MAX_READ).decode(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        self.events_file.close()
        return events


def summary(events: list[dict[str, Any]]) -> str:
    """``blocked: a:443 (3×), b:80 — add --allow-domain a to allow`` (one line; empty if none)."""
    if not events:
        return ""
    counts: dict[str, int] = {}
    for e in events:
        counts[str(e.get("target"))] = counts.get(str(e.get("target")), 0) + int(e.get("count", 1))
    shown = ", ".join(f"{t}" + (f" ({n}x)" if n > 1 else "") for t, n in list(counts.items())[:8])
    more = f" and {len(counts) - 8} more" if len(counts) > 8 else ""
    first = str(events[0].get("reason", ""))
    hint = first[first.find("add "):] if "add " in first else first
    line = f"blocked: {shown}{more} — {hint}"[:2000]
    return printable(line)
