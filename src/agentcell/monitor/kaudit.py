"""Landlock denials from the kernel's audit stream (NETLINK_AUDIT), read as a passive listener.

Audit is switched on for as long as a reader is open (``AUDIT_SET`` enabled=1, which is what
``auditctl -e 1`` does) and put back as it was when the last reader closes. A reader binds the
read-only multicast group (no auditd, no pid registration). Each kernel event arrives as several
records sharing a serial (``audit(TS:SERIAL)``): a Landlock denial is type 1423
(``domain=… blockers=fs.read_file path=… | net.connect_tcp daddr=… dest=…``), followed by the
SYSCALL record (pid, exe) and an end-of-event record (1320) that completes it.
"""
from __future__ import annotations

import errno
import os
import shlex
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from .. import hostfs
from ..netlink import set_rcvbuf

NETLINK_AUDIT = 9
AUDIT_GET, AUDIT_SET = 1000, 1001
AUDIT_SYSCALL, AUDIT_EOE, AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN = 1300, 1320, 1423, 1424
AUDIT_NLGRP_READLOG = 1
_NLMSG = struct.Struct("=IHHII")
STATUS_FIELDS = ("mask", "enabled", "failure", "pid", "rate_limit", "backlog_limit", "lost", "backlog",
                 "feature_bitmap", "backlog_wait_time", "backlog_wait_time_actual")  # struct audit_status
_STATUS = struct.Struct(f"={len(STATUS_FIELDS)}I")


def _status_request(sock: socket.socket, kind: int, payload: bytes = b"") -> bytes:
    sock.send(_NLMSG.pack(_NLMSG.size + len(payload), kind, 1 | 4 if payload else 1, 1, 0) + payload)
    return sock.recv(65536)


def audit_status(timeout: float | None = None) -> tuple[int, ...]:
    """struct audit_status, its fields in STATUS_FIELDS' order (as many as this kernel has). Read-only.
    Raises OSError with the kernel's errno when it refuses (audit netlink answers only in the initial user
    and network namespace, and AUDIT_GET needs CAP_AUDIT_CONTROL), TimeoutError after ``timeout``."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT) as s:
        s.settimeout(timeout)
        s.bind((0, 0))
        reply = _status_request(s, AUDIT_GET)
        length, kind, _f, _seq, _pid = _NLMSG.unpack_from(reply)
        if kind == 2 and (err := -struct.unpack_from("=i", reply, _NLMSG.size)[0]):  # NLMSG_ERROR
            raise OSError(err, f"AUDIT_GET: {os.strerror(err)}")
        if kind != AUDIT_GET:
            raise OSError("the kernel did not answer AUDIT_GET")
        n = min((length - _NLMSG.size) // 4, len(STATUS_FIELDS))
        return struct.unpack_from(f"={n}I", reply, _NLMSG.size)


def audit_enabled() -> int:
    """The audit 'enabled' flag: 0, 1, or 2 (locked)."""
    return int(audit_status()[1])


def audit_lost() -> int:
    """Records the kernel has dropped since boot (its backlog was full): host-wide."""
    return int(audit_status()[6])


AUDIT_STATUS_ENABLED, AUDIT_STATUS_BACKLOG_LIMIT = 0x1, 0x10
BACKLOG = 8192  # records the kernel may hold for its readers while monitors run (its default: 64)


def set_audit_enabled(value: int) -> None:
    _set(AUDIT_STATUS_ENABLED, enabled=value)


def set_audit_backlog(limit: int) -> None:
    _set(AUDIT_STATUS_BACKLOG_LIMIT, backlog=limit)


def _set(mask: int, *, enabled: int = 0, backlog: int = 0) -> None:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT) as s:
        s.bind((0, 0))
        reply = _status_request(s, AUDIT_SET, _STATUS.pack(mask, enabled, 0, 0, 0, backlog, 0, 0, 0, 0, 0))
        _len, kind, _f, _seq, _pid = _NLMSG.unpack_from(reply)
        if kind == 2:  # NLMSG_ERROR
            err = -struct.unpack_from("=i", reply, _NLMSG.size)[0]
            if err:
                raise OSError(err, os.strerror(err))


def field(text: str, key: str) -> str:
    """One unquoted ``key=value`` of a record, found without parsing the rest ("" if absent)."""
    at = text.find(f" {key}=") + 1 if not text.startswith(f"{key}=") else 0
    if at == 0 and not text.startswith(f"{key}="):
        return ""
    start = at + len(key) + 1
    end = text.find(" ", start)
    return text[start:] if end < 0 else text[start:end]


def parse_fields(text: str) -> dict[str, str]:
    """key=value pairs of a record (values may be quoted or hex-encoded)."""
    out: dict[str, str] = {}
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    for w in words:
        k, eq, v = w.partition("=")
        if eq:
            out[k] = v
    return out


USERS = f"{hostfs.RUN}/audit-users"  # one file per reader (its pid); the state before the first


def _acquire() -> None:
    """Audit on while any reader runs, in any process; the state before the first is put back by the
    last (a reader that died is swept: its pid is gone)."""
    import fcntl

    hostfs.run_dir("audit-users")
    lock = os.open(os.path.join(USERS, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        live = _live_readers()
        if not live:
            previous = os.path.join(USERS, ".previous")
            st = audit_status()
            if not os.path.exists(previous):  # else a reader died before restoring: that value still stands
                with open(previous, "w") as f:
                    f.write(f"{st[1]} {st[5]}")  # enabled, backlog_limit
            set_audit_enabled(1)
            if st[5] < BACKLOG:  # a burst elsewhere on the host must not crowd the cell's records out
                set_audit_backlog(BACKLOG)
        open(os.path.join(USERS, str(os.getpid())), "w").close()
    finally:
        os.close(lock)


def _release() -> None:
    import fcntl

    lock = os.open(os.path.join(USERS, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            os.unlink(os.path.join(USERS, str(os.getpid())))
        except FileNotFoundError:
            pass
        if not _live_readers():
            previous, backlog = 0, 0
            try:
                with open(os.path.join(USERS, ".previous")) as f:
                    words = f.read().split()
                previous = int(words[0]) if words else 0
                backlog = int(words[1]) if len(words) > 1 else 0
            except (OSError, ValueError):
                pass
            if backlog and audit_status()[5] != backlog:
                set_audit_backlog(backlog)
            if previous == 0:
                set_audit_enabled(0)
            try:
                os.unlink(os.path.join(USERS, ".previous"))
            except FileNotFoundError:
                pass
    finally:
        os.close(lock)


def _live_readers() -> list[int]:
    live = []
    for name in os.listdir(USERS):
        if name.isdigit():
            if os.path.exists(f"/proc/{name}"):
                live.append(int(name))
            else:
                os.unlink(os.path.join(USERS, name))
    return live


class AuditReader:
    """The multicast reader; :meth:`read` returns Landlock denials completed so far."""

    def __init__(self) -> None:
        _acquire()
        try:
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
            set_rcvbuf(self.sock, 16 << 20)
            self.sock.bind((0, 1 << (AUDIT_NLGRP_READLOG - 1)))
        except BaseException:
            _release()
            raise
        self.pending: dict[str, dict[str, Any]] = {}
        # Landlock domain -> (pid, uid) of the process that made it, from the kernel's record of it
        # (written with the domain's first denial, before that denial's SYSCALL record): who denied is
        # known without following forks. Bounded: the host's other Landlock users can make many.
        self.domains: dict[str, tuple[int, int]] = {}
        self.on_read: Callable[[], None] | None = None  # called for each message read (the watchdog's progress)

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self, accept: Callable[[int, str], bool] | None = None, limit: int = 4096) -> list[dict[str, Any]]:
        """What can be read now (at most ``limit`` messages: the caller's loop must come round),
        without blocking; completed denials. ``accept(pid, domain)`` keeps only the denials that
        matter: the rest are dropped before any parsing (the host's other Landlock users can be loud)."""
        out: list[dict[str, Any]] = []
        for _ in range(limit):
            if self.on_read is not None:
                self.on_read()
            try:
                data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)  # (not setblocking: a call more per read)
            except BlockingIOError:
                return out
            except OSError as e:
                if e.errno != errno.ENOBUFS:  # a closed or broken socket: the source has stopped
                    raise
                out.append({"lost": True, "ts": time.time()})  # the kernel dropped records; say so
                continue
            if len(data) < _NLMSG.size:
                continue
            length, kind, _f, _seq, _pid = _NLMSG.unpack_from(data)
            if kind not in (AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN, AUDIT_SYSCALL, AUDIT_EOE):
                continue
            text = data[_NLMSG.size:length].decode(errors="replace").rstrip("\0")
            head, _, body = text.partition("): ")
            serial = head.rpartition(":")[2]
            done = self._record(kind, serial, body, accept)
            if done is not None:
                out.append(done)
        return out

    def _record(self, kind: int, serial: str, body: str,
                accept: Callable[[int, str], bool] | None) -> dict[str, Any] | None:
        if kind == AUDIT_LANDLOCK_ACCESS:
            self.pending[serial] = {"raw": body, "ts": time.time()}
            if len(self.pending) > 4096:  # records whose end never came: drop the oldest
                self.pending.pop(next(iter(self.pending)))
        elif kind == AUDIT_LANDLOCK_DOMAIN:
            # Read by field, not parsed whole: any process on the host can have such records written, with
            # a long exe (the fields it needs come before the untrusted exe and comm, which the kernel quotes).
            pid, uid = field(body, "pid"), field(body, "uid")
            if field(body, "status") == "allocated" and pid.isdigit():
                self.domains[field(body, "domain")] = (int(pid), int(uid) if uid.isdigit() else -1)
                if len(self.domains) > 4096:
                    self.domains.pop(next(iter(self.domains)))
        elif kind == AUDIT_SYSCALL and serial in self.pending:
            pid = field(body, "pid")
            if accept is not None and not accept(int(pid) if pid.isdigit() else -1,
                                                 field(self.pending[serial]["raw"], "domain")):
                del self.pending[serial]  # another process's: never parsed
                return None
            self.pending[serial]["syscall"] = parse_fields(body)
        elif kind == AUDIT_EOE and serial in self.pending:
            done = self.pending.pop(serial)
            done["landlock"] = parse_fields(done.pop("raw"))
            return done
        return None

    def close(self) -> None:
        self.sock.close()
        _release()
