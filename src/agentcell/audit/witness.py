"""Witnesses: append-only sinks off the host that keep the trail's signed tree heads (:mod:`.seal`).

A witness is named by a spec:

==================================  ============================================================================
``file:/PATH`` (or ``/PATH``)        a file, opened ``O_APPEND``: one head per line, each written in one
                                     ``write`` and fsynced. Useful on another host's mount (NFS, a
                                     write-only share) that this host's root cannot rewrite.
``http://HOST[:PORT][/BASE]``        the witness protocol over HTTP(S): ``POST BASE/heads`` appends one head
``https://…``                        (a JSON object; any 2xx is taken), ``GET BASE/heads`` lists them (JSON
                                     lines). ``agentcell audit witness serve`` is a reference server.
``syslog://HOST[:PORT]``             an RFC 5424 line over UDP (port 514), facility authpriv, severity notice,
``syslog+tcp://HOST[:PORT]``         app ``agentcell``, msgid ``tree-head``, the head as its message; over TCP
                                     with RFC 6587 octet counting. A syslog witness is read back from the file
                                     its server writes (``--witness file:PATH`` to ``verify``).
==================================  ============================================================================

The witness need not check anything: it must keep what it is sent, and be out of reach of whoever
later owns this host. ``verify`` does all the checking, offline. Proxies in the environment are not
used (a witness is reached directly, as a syslog server is).
"""
from __future__ import annotations

import json
import os
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import AgentcellError

SEND_TIMEOUT_S = 5.0
MAX_HEAD = 1 << 20  # bytes of one head, as a witness takes it (a head of 512 leaves is ~40 KB)
MAX_STORE_READ = 1 << 30
PRI = 10 * 8 + 5  # authpriv.notice


class WitnessError(AgentcellError):
    """A witness spec that names none, or a witness that cannot be read."""


@dataclass(frozen=True)
class Witness:
    kind: str  # file | http | syslog | syslog+tcp
    target: str  # the path, the base URL, or the host
    port: int = 0

    def __str__(self) -> str:
        return {"file": f"file:{self.target}", "http": self.target}.get(
            self.kind, f"{self.kind}://{_host_text(self.target)}:{self.port}")


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse(spec: str, field: str = "--audit-witness") -> Witness:
    """A spec as the table above has it; a WitnessError naming ``field`` otherwise."""
    text = spec.strip()
    fix = "e.g. file:/mnt/witness/heads, https://witness.example/agentcell, syslog://logs.example:514"
    if not text or any(c in text for c in "\0\n\r"):
        raise WitnessError(field, f"{spec!r} is not a witness", fix)
    if text.startswith("file:") or text.startswith("/"):
        path = text.removeprefix("file:")
        if path.startswith("//"):  # file:///path
            path = path[2:]
        if not path.startswith("/"):
            raise WitnessError(field, f"{text}: a witness file is named by its absolute path", fix)
        return Witness("file", os.path.normpath(path))
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise WitnessError(field, f"'{text}' names no witness (file:, http://, https://, syslog://, "
                           "syslog+tcp://)", fix)
    if scheme in ("http", "https"):
        from urllib.parse import urlsplit

        try:
            u = urlsplit(text)
            u.port  # noqa: B018 - (a bad port raises here)
        except ValueError as e:
            raise WitnessError(field, f"'{text}' is not a URL ({e})", fix) from None
        if not u.hostname or u.query or u.fragment or u.username or u.password:
            raise WitnessError(field, f"'{text}' is not a witness URL (a host, an optional base path; no "
                               "query, fragment or credentials)", fix)
        return Witness("http", text.rstrip("/"))
    if scheme in ("syslog", "syslog+tcp"):
        host, port = _host_port(rest.rstrip("/"), 514, field, fix)
        return Witness(scheme, host, port)
    raise WitnessError(field, f"'{scheme}' is not a kind of witness (file:, http://, https://, syslog://, "
                       "syslog+tcp://)", fix)


def _host_port(text: str, default: int, field: str, fix: str) -> tuple[str, int]:
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    try:
        port = int(port_text) if port_text else default
    except ValueError:
        port = -1
    if not host or not 0 < port < 65536 or "/" in host:
        raise WitnessError(field, f"'{text}' is not HOST[:PORT]", fix)
    return host, port


def line_of(head: dict[str, Any]) -> bytes:
    return json.dumps(head, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def send(w: Witness, head: dict[str, Any]) -> None:
    """Deliver one head; OSError (with what went wrong) if the witness did not take it."""
    body = line_of(head)
    if w.kind == "file":
        fd = os.open(w.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{w.target} is not a regular file")
            if os.write(fd, body + b"\n") != len(body) + 1:
                raise OSError(28, "short write (no space left on the witness?)")
            os.fsync(fd)
        finally:
            os.close(fd)
    elif w.kind == "http":
        _http(w.target + "/heads", body)
    else:
        msg = _syslog_line(body)
        family = socket.AF_INET6 if ":" in w.target else socket.AF_INET
        if w.kind == "syslog":
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.sendto(msg, (w.target, w.port))
        else:
            with socket.create_connection((w.target, w.port), timeout=SEND_TIMEOUT_S) as s:
                s.sendall(b"%d " % len(msg) + msg)  # RFC 6587 octet counting


def _syslog_line(body: bytes) -> bytes:
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    host = socket.gethostname() or "-"
    return f"<{PRI}>1 {stamp} {host} agentcell {os.getpid()} tree-head - ".encode() + body


def _opener() -> Any:
    import urllib.request

    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(url: str, body: bytes) -> None:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with _opener().open(req, timeout=SEND_TIMEOUT_S) as r:
            r.read(4096)
    except urllib.error.HTTPError as e:
        raise OSError(f"{url} answered {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise OSError(f"{url}: {e.reason}") from None


def read(w: Witness, field: str = "--witness") -> list[bytes]:
    """The lines the witness holds (each a head, possibly behind a syslog header)."""
    if w.kind == "file":
        from ..hostfs import open_regular

        fd = open_regular(w.target, field, "give the file the witness writes (a regular file)")
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_STORE_READ)
        return data.splitlines()
    if w.kind == "http":
        import urllib.error
        import urllib.request

        url = w.target + "/heads"
        try:
            with _opener().open(urllib.request.Request(url, method="GET"), timeout=30) as r:
                body: bytes = r.read(MAX_STORE_READ)
        except urllib.error.HTTPError as e:
            raise WitnessError(field, f"{url} answered {e.code} {e.reason}", "is it an agentcell witness?") \
                from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise WitnessError(field, f"cannot read {url}: {reason}", "check that the witness runs") from None
        return body.splitlines()
    raise WitnessError(field, f"a syslog witness ({w}) cannot be read back over syslog",
                       "give the file its server writes: --witness file:PATH")


def heads_in(lines: list[bytes]) -> list[tuple[int, Any]]:
    """(line number, parsed JSON or None) for each line that holds a head (from its first '{': a syslog
    server's own header goes before it)."""
    out: list[tuple[int, Any]] = []
    for n, line in enumerate(lines, 1):
        start = line.find(b"{")
        if start < 0 or b"agentcell_head" not in line:
            continue
        try:
            out.append((n, json.loads(line[start:])))
        except (ValueError, RecursionError):
            out.append((n, None))
    return out


# ---- the reference witness: agentcell audit witness serve ------------------------------------

def serve(listen: str, store: str) -> int:
    """Serve the witness protocol on ``listen`` (HOST:PORT), appending each head to ``store`` (one line,
    one ``write``, fsynced, never rewritten). Runs until SIGTERM or SIGINT."""
    import signal
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    host, port = _host_port(listen, 0, "--listen", "e.g. --listen 0.0.0.0:8788")
    if port == 0:
        raise WitnessError("--listen", f"'{listen}' names no port", "e.g. --listen 0.0.0.0:8788")
    try:
        fd = os.open(store, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise WitnessError("--store", f"cannot open {store}: {e.strerror}", "give a file this user may write") \
            from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise WitnessError("--store", f"{store} is not a regular file", "give a file")
    write_lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        server_version = "agentcell-witness/1"

        def _answer(self, code: int, body: bytes = b"", kind: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802 - (http.server's name)
            if self.path.split("?")[0].rstrip("/").rsplit("/", 1)[-1] != "heads":
                return self._answer(404, b"POST /heads\n")
            try:
                length = int(self.headers.get("Content-Length") or -1)
            except ValueError:
                length = -1
            if not 0 < length <= MAX_HEAD:
                return self._answer(413 if length > MAX_HEAD else 411, b"one head, at most 1 MiB\n")
            try:
                head = json.loads(self.rfile.read(length))
            except (ValueError, RecursionError):
                return self._answer(400, b"not JSON\n")
            if not isinstance(head, dict) or head.get("agentcell_head") != 1:
                return self._answer(400, b"not a tree head\n")
            line = line_of(head) + b"\n"
            with write_lock:
                os.write(fd, line)
                os.fsync(fd)
            self._answer(201, b"stored\n")

        def do_GET(self) -> None:  # noqa: N802
            if self.path.split("?")[0].rstrip("/").rsplit("/", 1)[-1] != "heads":
                return self._answer(404, b"GET /heads\n")
            with open(store, "rb") as f:
                self._answer(200, f.read(MAX_STORE_READ), "application/x-ndjson")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the store is the record
            pass

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    try:
        httpd = Server((host, port), Handler)
    except OSError as e:
        raise WitnessError("--listen", f"cannot listen on {listen}: {e.strerror}", "give a free address") \
            from None

    def stop(_sig: int, _frame: object) -> None:
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    bound = httpd.server_address
    sys.stderr.write(f"agentcell audit witness: http://{_host_text(str(bound[0]))}:{bound[1]}/heads, "
                     f"storing in {store}\n")
    sys.stderr.flush()
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        os.close(fd)
    return 0
