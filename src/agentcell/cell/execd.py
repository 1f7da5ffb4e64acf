"""A live cell's exec server: many commands in one cell, each forked from one process that is already
confined, so every command shares the cell's namespaces, mounts, Landlock domain (signals and abstract
sockets reach each other, as within one command's tree) and seccomp filter (one listener for the
monitor).

Child side, :func:`serve`: the cell's command process, once identity, Landlock and seccomp are in
place, does not exec; it serves requests on the hand-off channel and forks a command for each. It runs
as the agent's account and is non-dumpable, so the agent can neither read its memory or fds nor trace
it (seccomp refuses ptrace); it can only kill it, which ends its own cell. It holds the launcher's
memory image: a warm launcher's other cells' policies, never their secrets (a session's secrets are
the cell's own environment).

Supervisor side, :class:`Channel`: requests go out framed (length, fd count, ``marshal`` payload, the
fds as SCM_RIGHTS with it); reports come back as fixed-size records the supervisor parses by struct,
never by an unmarshal of what the cell wrote::

    supervisor -> {"op": "exec", "id": N, "argv": [...], "env": {...}, "cwd": DIR, "fds": [0, 1, 2]} + fds
    supervisor -> {"op": "signal", "id": N, "sig": S}
    supervisor -> {"op": "attach"} + fd     a lane: a second channel, for a client of the supervisor's
    cell       -> b"X" id code sig     it ended (code 128+N for a signal)
    cell       -> b"F" id code errno   it never started (127 not found, 126 not runnable; errno | NO_CWD
                                       when its working directory could not be entered)

A command's start is not reported: no one used it, and it woke the supervisor once more per command
while the command ran.

A **lane** (at most one, attached by the supervisor) takes ``exec`` and ``signal`` requests as the
channel does, with request ids of its own, and gets the reports of its commands: a live cell's private
client (:class:`agentcell.host.liveclient.RemoteLive`) sends its commands on it, so that each skips the
cell host's relay (two wake-ups of one process by another, and the relay's work, per command). The
server ends, and with it the cell, when either channel ends or fails, as when the channel alone did.
"""
from __future__ import annotations

import _socket
import errno
import marshal
import os
import select
import struct
import time

from . import syscalls as sc
from .handoff import pack_fds, unpack_fds
from .spec import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, NoReturn

_REQUEST = struct.Struct("!II")  # payload length, number of fds sent with it
_REPORT = struct.Struct("!cIii")  # kind, request id, two numbers
NO_CWD = 1 << 16  # in a command that never started: its working directory could not be entered
MAX_FDS = 8
MAX_REQUEST = 4 << 20  # argv and environment of one command
MAX_QUEUED = 32 << 20  # bytes of requests waiting for a server that does not read (it is stopped, or busy)
FD_HEADROOM = MAX_FDS + 16  # fds of the server's own beside its commands' pidfds (stdio, the channel, ...)
MAX_HELD = 64  # requests waiting with their fds: the copies are fds of the supervisor's own
MAX_SIG = 64  # a signal a client may ask for a command (1-MAX_SIG)
KILL = 9
MAX_LANE_BACKLOG = 1 << 20  # bytes of reports waiting for a lane's client (80,000 commands' ends)


# ---- supervisor side --------------------------------------------------------------------------------


class Channel:
    """The supervisor's end of a live cell's hand-off channel. Requests are sent without waiting: what the
    server does not take yet (a command can stop it: it runs as the agent) waits here, in order, and goes
    as the channel is writable (:meth:`flush`, when :attr:`pending`); a supervisor blocked on a send would
    serve nothing more, and never see the server stopped."""

    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.closed = False
        # (what is left of a request, the fds of ours that go with its first byte): few, and rarely any
        self._out: list[tuple[memoryview, list[int]]] = []
        self._queued = 0  # bytes
        self._held = 0  # requests with fds (each holds copies of its fds here)

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def pending(self) -> bool:
        """Requests wait for the server to take them."""
        return bool(self._out)

    def exec(self, rid: int, argv: Sequence[str], env: dict[bytes, bytes], cwd: str, fds: dict[int, int]) -> None:
        """Start ``argv`` in ``env`` (encoded: :func:`encoded`); ``fds`` maps the number the command sees
        to our fd. Raises OSError when the cell is gone, or when too much waits for a server that does
        not read (ENOBUFS)."""
        self._send(exec_request(rid, argv, env, cwd, list(fds)), list(fds.values()))

    def signal(self, rid: int, sig: int) -> None:
        try:
            self._send({"op": "signal", "id": rid, "sig": sig}, [])
        except OSError:
            pass  # the cell is gone: so is the command

    def attach(self, fd: int) -> None:
        """Give the server ``fd`` (a stream socket's end) as its lane; raises OSError when the cell is gone."""
        self._send({"op": "attach"}, [fd])

    def _send(self, msg: dict[str, Any], fds: list[int]) -> None:
        data = memoryview(request(msg, fds))
        sent = 0
        if not self._out:
            try:
                sent = self._sendmsg(data, fds)
            except BlockingIOError:
                pass
            if sent == len(data):
                return
        # What waits is bounded (a signal, without fds, always waits: it is small, and a kill must not be lost).
        if fds and sent == 0 and (self._queued + len(data) > MAX_QUEUED or self._held >= MAX_HELD):
            raise OSError(errno.ENOBUFS, "the cell's exec server is not taking requests")
        self._queue(data[sent:], _copies(fds) if sent == 0 else [])  # (the fds went with the first byte sent)

    def _sendmsg(self, data: memoryview, fds: list[int]) -> int:
        anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pack_fds(fds))] if fds else []
        return self.sock.sendmsg([data], anc, _socket.MSG_DONTWAIT)

    def _queue(self, data: memoryview, fds: list[int]) -> None:
        self._out.append((data, fds))
        self._queued += len(data)
        self._held += bool(fds)

    def flush(self) -> None:
        """Send what waits, as much as the server takes now. Raises OSError when a request cannot be
        handed over (EPIPE: the cell is gone; another error: the caller ends the cell); what waited is
        dropped with it."""
        while self._out:
            data, fds = self._out[0]
            try:
                sent = self._sendmsg(data, fds)
            except BlockingIOError:
                return
            except OSError:
                self._drop()
                raise
            for fd in fds:
                os.close(fd)
            self._held -= bool(fds)
            self._queued -= sent
            if sent < len(data):
                self._out[0] = (data[sent:], [])
                return
            del self._out[0]

    def _drop(self) -> None:
        for _data, fds in self._out:
            for fd in fds:
                os.close(fd)
        self._out.clear()
        self._queued = self._held = 0

    def reports(self) -> list[tuple[str, int, int, int]] | None:
        """What the cell has reported since the last call, without blocking; None once it is gone."""
        if self.closed:
            return None
        try:
            chunk = self.sock.recv(1 << 16, _socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        except OSError:
            chunk = b""
        if not chunk:
            self.closed = True
            return None
        out, self._buf = parse_reports(self._buf + chunk)
        return out

    def close(self) -> None:
        """No more commands: the server exits, and PID 1 ends the cell with everything still in it."""
        if not self.closed:
            self.closed = True
        self._drop()
        try:
            self.sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def request(msg: dict[str, Any], fds: list[int]) -> bytes:
    """One request as it goes on a channel (the ``fds`` go with its first byte)."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} fds per command")
    payload = marshal.dumps(msg)
    if len(payload) > MAX_REQUEST:
        raise ValueError(f"argv and environment of {len(payload):,} bytes (at most {MAX_REQUEST:,})")
    return _REQUEST.pack(len(payload), len(fds)) + payload


def exec_request(rid: int, argv: Sequence[str], env: dict[bytes, bytes], cwd: str, targets: Sequence[int]) -> \
        dict[str, Any]:
    return {"op": "exec", "id": rid, "argv": [os.fsencode(a) for a in argv], "env": env, "cwd": os.fsencode(cwd),
            "fds": list(targets)}


def parse_reports(buf: bytes) -> tuple[list[tuple[str, int, int, int]], bytes]:
    """The whole reports in ``buf`` (ends and failures to start), and what is left of it."""
    out = []
    while len(buf) >= _REPORT.size:
        kind, rid, a, b = _REPORT.unpack_from(buf)
        buf = buf[_REPORT.size:]
        if kind in (b"X", b"F"):
            out.append((kind.decode(), rid, a, b))
    return out, buf


def malformed(argv: object, env: object, cwd: object) -> str:
    """What is wrong with a command's request as a client makes it (a list of strings, a dict of strings,
    an absolute path or None), or ""."""
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
        return "argv must be a list of strings without NUL"
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in env.items()):
        return "env must map NAME (no '=', no NUL) to a string"
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd):
        return "cwd must be an absolute path"
    return ""


def end_message(cid: int, kind: str, a: int, b: int, started: float, name: str, cwd: str,
                timed_out: bool = False) -> dict[str, Any]:
    """A command's end, reported by the server (``kind``, ``a``, ``b``: see the module's doc), as its client
    is told it: by the cell host for a command it relayed, by the client itself for one on its lane.
    ``started``: ``time.monotonic()`` when it was asked for; ``timed_out``: the host killed it at its
    deadline (124)."""
    code, sig = (124, KILL) if timed_out else (a, 0) if kind == "F" else (a, b)
    msg: dict[str, Any] = {"id": cid, "event": "exit", "exit_status": code, "signal": sig, "timed_out": timed_out,
                           "duration_s": round(time.monotonic() - started, 6), "ended": None}
    if kind == "F":
        msg["not_started"] = _not_started(name, cwd, a, b)
    return msg


def _not_started(name: str, cwd: str, code: int, err: int) -> str:
    """Why a command never started, as a shell would say it (the server reports a code and errno)."""
    if err & NO_CWD:
        return f"agentcell: {cwd[:256]}: {os.strerror(err & 0xFFFF)}"
    what = "command not found in the cell" if code == 127 else os.strerror(err & 0xFFFF)
    return f"agentcell: {name[:256]}: {what}"


def _copies(fds: list[int]) -> list[int]:
    """Our own copies of ``fds`` (the caller closes its own), all or none."""
    out: list[int] = []
    try:
        for fd in fds:
            out.append(os.dup(fd))
    except BaseException:
        for fd in out:
            os.close(fd)
        raise
    return out


def encoded(env: dict[str, str]) -> dict[bytes, bytes]:
    """An environment as a command gets it (the cell's own is encoded once, not for every command)."""
    return {os.fsencode(k): os.fsencode(v) for k, v in env.items()}


# ---- child side: the cell's command process, confined, as the agent --------------------------------


def serve(ctl: _socket.socket) -> NoReturn:
    sc.prctl(sc.PR_SET_DUMPABLE, 0)  # setresuid may have made us dumpable again (fs.suid_dumpable)
    ctl.setblocking(True)
    chans = {ctl.fileno(): _Chan(ctl, main=True)}
    running: dict[int, tuple[_Chan, int, int]] = {}  # pidfd -> (its channel, request id, pid)
    waits = select.poll()  # the channels and each command's pidfd, kept (not a list made for each wait)
    # Each running command holds a pidfd of ours: near our fd limit the channels are not read (their requests
    # wait there) until one ends, so that a request's fds are never cut off by our own load (that ends the server).
    room, listening = os.sysconf("SC_OPEN_MAX") - FD_HEADROOM, True
    while True:
        _arm(waits, chans, listening)
        for r, ev in waits.poll():
            ch = chans.get(r)
            if ch is not None:
                if ev & select.POLLOUT:
                    _flush(ch)
                if not ev & (select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    continue
                try:  # (close-on-exec as they come: only as a command's 0-2, dup2'd, do they cross its exec)
                    chunk, anc, flags, _addr = ch.sock.recvmsg(1 << 16, _socket.CMSG_SPACE(MAX_FDS * 4),
                                                               _socket.MSG_CMSG_CLOEXEC)
                except InterruptedError:
                    continue
                except OSError:
                    chunk, anc, flags = b"", [], 0
                if not chunk or flags & _socket.MSG_CTRUNC:
                    # EOF: the supervisor (or the client of the lane) is done with the cell, or gone. Fds cut
                    # off (a command lowered our RLIMIT_NOFILE, prlimit): the requests can no longer be matched
                    # with theirs. Either way the server ends, and PID 1 the cell.
                    os._exit(0)
                ch.buf += chunk
                ch.fds_in += unpack_fds(anc)
                while len(ch.buf) >= _REQUEST.size:
                    length, nfds = _REQUEST.unpack_from(ch.buf)
                    if len(ch.buf) < _REQUEST.size + length or len(ch.fds_in) < nfds:
                        break
                    msg = marshal.loads(ch.buf[_REQUEST.size:_REQUEST.size + length])
                    ch.buf = ch.buf[_REQUEST.size + length:]
                    fds, ch.fds_in = ch.fds_in[:nfds], ch.fds_in[nfds:]
                    if msg.get("op") == "attach":
                        _attach(ch, fds, chans)
                    else:
                        _handle(ch, msg, fds, running, waits)
                if running and len(running) >= room:
                    listening = False
            else:
                ch, rid, pid = running.pop(r)
                waits.unregister(r)
                os.close(r)
                ch.by_id.pop(rid, None)
                code, sig = 255, 0
                try:
                    _, wstatus = os.waitpid(pid, 0)
                    if os.WIFSIGNALED(wstatus):
                        code, sig = 128 + os.WTERMSIG(wstatus), os.WTERMSIG(wstatus)
                    else:
                        code = os.waitstatus_to_exitcode(wstatus)
                except ChildProcessError:
                    pass
                _tell(ch, b"X", rid, code, sig)
                if len(running) < room:
                    listening = True


class _Chan:
    """A channel the server reads requests from: the supervisor's (``main``), or one lane a client of the
    supervisor's was handed (:meth:`Channel.attach`). Request ids are each channel's own; a command's end
    is reported on the channel that asked for it."""

    def __init__(self, sock: _socket.socket, main: bool = False) -> None:
        self.sock, self.main = sock, main
        self.buf, self.fds_in = b"", list[int]()
        self.by_id: dict[int, int] = {}  # request id -> pid
        self.out = bytearray()  # a lane's reports its client has not taken yet
        self.mask = 0  # what the poll waits for on it


def _arm(waits: select.poll, chans: dict[int, _Chan], listening: bool) -> None:
    """Each channel waited on for what it needs now: requests (while there is room for them), and, for a
    lane with reports its client has not taken, room to send them."""
    for fd, ch in chans.items():
        mask = (select.POLLIN if listening else 0) | (select.POLLOUT if ch.out else 0)
        if mask != ch.mask:
            if mask:
                waits.register(fd, mask)
            else:
                waits.unregister(fd)
            ch.mask = mask


def _attach(ch: _Chan, fds: list[int], chans: dict[int, _Chan]) -> None:
    """A lane, from the supervisor's channel only, and one at most: anything else is closed unread."""
    if not ch.main or len(fds) != 1 or len(chans) > 1:
        for fd in fds:
            os.close(fd)
        return
    sock = _socket.socket(fileno=fds[0])
    sock.setblocking(True)
    chans[sock.fileno()] = _Chan(sock)


def _tell(ch: _Chan, kind: bytes, rid: int, a: int, b: int) -> None:
    """A report on ``ch``. The supervisor's channel is waited on (it always reads). A lane is not: what its
    client does not take yet (it is stopped, or busy) waits here, bounded by MAX_LANE_BACKLOG (the ends of
    commands it started), and goes as it reads. A channel that fails ends the server, and the cell."""
    report = _REPORT.pack(kind, rid, a, b)
    if ch.main:
        try:
            ch.sock.sendall(report)
        except OSError:
            os._exit(0)
        return
    ch.out += report
    if len(ch.out) > MAX_LANE_BACKLOG:
        os._exit(0)
    _flush(ch)


def _flush(ch: _Chan) -> None:
    while ch.out:
        try:
            sent = ch.sock.send(ch.out, _socket.MSG_DONTWAIT | _socket.MSG_NOSIGNAL)
        except BlockingIOError:
            return
        except OSError:
            os._exit(0)
        del ch.out[:sent]


def _handle(ch: _Chan, msg: dict[str, Any], fds: list[int], running: dict[int, tuple[_Chan, int, int]],
            waits: select.poll) -> None:
    rid = int(msg["id"])
    if msg["op"] == "signal":
        pid = ch.by_id.get(rid)
        if pid is not None:
            try:
                os.killpg(pid, int(msg["sig"]))  # its own session and process group (setsid below)
            except (OSError, ValueError, OverflowError):
                try:
                    os.kill(pid, int(msg["sig"]))
                except (OSError, ValueError, OverflowError):
                    pass
        return
    try:
        try:
            os.chdir(msg["cwd"])
        except OSError as e:
            raise _NoCwd(e.errno, e.strerror) from None
        pid = _spawn(msg, fds)
    except (OSError, ValueError, TypeError, OverflowError) as e:  # the server serves on, whatever one request was
        # Said by the supervisor's side, which words it (the server never writes to a command's fds: what reads
        # them may be a command the agent stopped, or one that holds the pipe's lock, and it serves everyone).
        code = 127 if isinstance(e, FileNotFoundError) else 126
        err = (getattr(e, "errno", None) or errno.EINVAL) & 0xFFFF
        _tell(ch, b"F", rid, code, err | (NO_CWD if isinstance(e, _NoCwd) else 0))
        return
    finally:
        for fd in fds:
            os.close(fd)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # it cannot have been reaped yet: only we wait for it
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        _tell(ch, b"X", rid, 125, 0)
        return
    running[pidfd] = (ch, rid, pid)
    ch.by_id[rid] = pid
    waits.register(pidfd, select.POLLIN)


class _NoCwd(OSError):
    """The command's working directory cannot be entered."""


def _spawn(msg: dict[str, Any], fds: list[int]) -> int:
    """One command, in a session of its own, its fds on their numbers and nothing else (every fd of
    ours is close-on-exec), by posix_spawn: vfork and exec, no copy of our memory (a fork of this
    process costs more than the command here). Its working directory is ours at that moment (we are
    single-threaded: the caller has entered it); PATH is searched in the command's environment. A PATH
    entry without the name is passed over on a stat, not on a spawn that fails: a process, and its
    fork, failed exec and exit for the monitor to read, for each entry before the right one."""
    env = msg["env"]
    actions = [(os.POSIX_SPAWN_DUP2, fd, int(target)) for fd, target in zip(fds, msg["fds"], strict=True)]
    name = msg["argv"][0]
    searched = b"/" not in name
    dirs = env.get(b"PATH", b"").split(b":") if searched else [b""]
    denied: OSError | None = None
    for d in dirs:
        path = os.path.join(d or b".", name) if searched else name
        try:
            if searched:
                os.stat(path)  # (a name that is not there fails here as its exec would: ENOENT, ENOTDIR)
            return os.posix_spawn(path, msg["argv"], env, file_actions=actions, setsid=True)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError as e:
            denied = e
    raise denied or FileNotFoundError(2, "not found", os.fsdecode(name))


def execvpe(argv: list[str], env: dict[str, str]) -> None:
    """execvpe without os.get_exec_path, which imports warnings (~2.5 ms in every cell here). Like
    execvp: search PATH, remember a permission error and keep looking, report it if nothing runs."""
    name = argv[0]
    dirs = [""] if "/" in name else env.get("PATH", "").split(":")
    denied: OSError | None = None
    for d in dirs:
        path = os.path.join(d or ".", name) if d or "/" not in name else name
        try:
            os.execve(path, argv, env)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError as e:
            denied = e
    if denied is not None:
        raise denied
    raise FileNotFoundError(2, "not found", name)
