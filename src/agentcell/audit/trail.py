"""The audit trail: append-only JSON lines, each chained to the one before by SHA-256.

    {"seq": 7, "ts": 1796040000.12, "session": "s-1", "event": "spawn", "details": {...}, "prev": "<hex>"}

``prev`` is the SHA-256 of the previous record's line (its exact bytes, without the newline); the
first record's is 64 zeros. Editing, inserting, removing or reordering a record breaks the chain at
that place. Cutting records off the end would not, so every append also rewrites a small anchor
beside the log (``<log>.head``: the last seq and the hash of the last line, replaced atomically
through a spare made in advance, ``<log>.head.spare``),
and a log shorter than its anchor is reported as truncated; a last line cut in the middle is too.

Appends take an exclusive lock on the log (``flock``) for read-last, write, fsync and anchor: any
number of writers, in any processes, produce one chain of whole lines. The log is opened with
``O_APPEND | O_NOFOLLOW``, written in one ``write``, fsynced (and so is the anchor and, when it is
new, the directory). A failed write is retried 3 times (0.05, 0.2, 0.5 s), then
:class:`AuditWriteError` is raised: the session treats it as fatal ("nothing runs unrecorded").

The default log is ``<state dir>/audit/audit.jsonl`` (root's, 0600 in a 0700 directory): cells never
see the state dir, so nothing inside one can write it.

All of that holds against everyone but root: a root can rewrite the file, recompute every ``prev`` and
the anchor, and :func:`verify` finds nothing. A trail sealed to a witness (:mod:`.seal`) also has signed
tree heads off the host, and ``agentcell audit verify --witness W --key K`` (:mod:`.witnessed`) catches
that. The record format is the same, sealed or not.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import time
from collections.abc import Iterator
from typing import Any

from .. import hostfs
from .base import AuditWriteError as AuditWriteError  # (where callers found it)
from .base import fsync_dir as _fsync_dir
from .base import lock as _lock

GENESIS = "0" * 64
RETRY_DELAYS = (0.05, 0.2, 0.5)


class _Broken(Exception):
    """The trail and its anchor disagree: appending would bury the damage; not retried."""


def default_path() -> str:
    from ..hostfs import state_dir

    return path_in(state_dir())


def path_in(state: str) -> str:
    """The trail of the state dir ``state``."""
    return os.path.join(state, "audit", "audit.jsonl")


def _digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def _last_line(fd: int, end: int | None = None) -> bytes:
    """The last complete line of the open log within its first ``end`` bytes (default: all of it; b"" if
    none), read backwards from there."""
    end = os.lseek(fd, 0, os.SEEK_END) if end is None else end
    if end == 0:
        return b""
    pos, buf = end, b""
    while pos > 0:
        step = min(65536, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
        body = buf[:-1] if buf.endswith(b"\n") else buf
        nl = body.rfind(b"\n")
        if nl >= 0:
            return body[nl + 1:]
    return buf[:-1] if buf.endswith(b"\n") else buf


class AuditLog:
    """A trail. When it is sealed (:mod:`.seal`: ``agentcell audit init --witness``), every append whose
    record makes a seal due signs a tree head and sends it to the witness; ``witness_problem`` then says
    what the witness did not take (the session decides whether that stops it), and :meth:`seal` seals
    at once (a session's end)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or default_path()
        self.head = self.path + ".head"
        self.witness_problem: str | None = None

    def append(self, event: str, *, session: str = "", **details: Any) -> dict[str, Any]:
        """Write one record; returns it. Raises AuditWriteError when it cannot be written, and
        :class:`~.seal.SealError` (an AuditWriteError) when it was written but cannot be sealed."""
        record = self._append_retried(event, session, details)
        if os.path.isdir(self.path + ".seal"):  # (one stat on a trail that is not sealed)
            self._sealed(force=False, seq=int(record["seq"]))
        return record

    def seal(self) -> str | None:
        """Seal every record not sealed yet and deliver every head the witness lacks, now; what the
        witness did not take (None: all of it, or the trail is not sealed)."""
        if not os.path.isdir(self.path + ".seal"):
            return None
        return self._sealed(force=True)

    def _sealed(self, *, force: bool, seq: int = 0) -> str | None:
        from . import seal

        try:
            if not force and not seal.due(self.path, seq):
                return None
            seal.seal(self.path, force=force)
            self.witness_problem = seal.deliver(self.path)
        except OSError as e:
            raise seal.SealError("audit", f"cannot seal {self.path} ({e})", "the record is written; "
                                 "'agentcell audit seal' retries") from None
        return self.witness_problem

    def seal_to(self, witness: str, every: int, interval: float) -> tuple[str, str | None]:
        """Seal this trail from now on (:func:`.seal.init`), recording it in an ``audit.seal`` record that
        the first head covers with everything before it; (epoch 0's key, what the witness did not take).
        A trail whose chain is broken is refused: sealing it would seal the damage."""
        from . import seal

        if os.path.lexists(self.path):
            v = verify(self.path)
            if not v.ok:
                n, problem = v.problems[0]
                raise AuditWriteError("FILE", f"{self.path}:{n}: {problem}", "a damaged trail is not sealed: "
                                      "keep it aside and start a new one")
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        key, log = seal.init(self.path, witness, every, interval)
        self.append("audit.seal", log=log, key=key, witness=seal.read_meta(seal.seal_dir(self.path))["witness"],
                    every=every, interval_s=interval)
        return key, self.seal()

    def _append_retried(self, event: str, session: str, details: dict[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        for delay in (0.0, *RETRY_DELAYS):
            if delay:
                time.sleep(delay)
            try:
                return self._append(event, session, details)
            except _Broken as e:
                raise AuditWriteError("audit", f"{self.path}: {e}", "nothing more is recorded until "
                                      "'agentcell audit verify' has been looked at") from None
            except (OSError, ValueError) as e:
                last = e
        raise AuditWriteError("audit", f"cannot write to {self.path} ({last})",
                              "the session stops: fix the log (space, permissions), then 'agentcell audit verify'")

    def _append(self, event: str, session: str, details: dict[str, Any]) -> dict[str, Any]:
        d = os.path.dirname(self.path)
        if not os.path.isdir(d):
            os.makedirs(d, mode=0o700, exist_ok=True)
            _fsync_dir(os.path.dirname(d))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or not hostfs.only_ours(fd, {os.geteuid()}):
                raise ValueError(f"{self.path} must be a regular file of ours that no one else can write (by its "
                                 "mode, an ACL or another name)")
            _lock(fd)
            rfd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                prev_line = _last_line(rfd)
            finally:
                os.close(rfd)
            seq, prev, last_prev = 1, GENESIS, None
            if prev_line:
                try:
                    rec = json.loads(prev_line)
                    seq, prev, last_prev = int(rec["seq"]) + 1, _digest(prev_line), rec["prev"]
                except (ValueError, KeyError, TypeError, RecursionError):
                    raise _Broken("its last record is damaged") from None
            head = _read_head(self.head)
            if prev_line and (head or (0, GENESIS)) == (seq - 2, last_prev):  # (no anchor: before the first)
                # A writer died between its record and its anchor (a crash, a kill -9): the record is
                # whole and follows the anchored one. Move the anchor onto it, as that writer would have.
                _write_head(self.head, seq - 1, prev)
                head = (seq - 1, prev)
            # The log must end where its anchor says: appending to a cut or replaced trail would give
            # it a new, valid-looking end and bury the damage.
            if head != ((seq - 1, prev) if prev_line else None):
                raise _Broken("it does not end where its anchor says (records were cut off or replaced, or "
                              "the anchor is gone)")
            record = {"seq": seq, "ts": round(time.time(), 6), "session": session, "event": event,
                      "details": details, "prev": prev}
            line = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
            start = os.lseek(fd, 0, os.SEEK_END)  # we hold the lock: nobody else appends meanwhile
            try:
                if os.write(fd, line + b"\n") != len(line) + 1:
                    raise OSError(28, "short write (no space left on device?)")
                os.fsync(fd)
                _write_head(self.head, seq, _digest(line))
            except OSError:
                # Not written unless log and anchor agree: no half record, no record the anchor does
                # not know (which verify would take for one added by hand).
                os.ftruncate(fd, start)
                os.fsync(fd)
                raise
            if seq == 1:
                _fsync_dir(d)
            return record
        finally:
            os.close(fd)  # releases the lock


def _head_text(path: str) -> str:
    """The anchor's text, read as a file anyone may have replaced must be: no link followed, no FIFO
    waited on, a regular file only, 256 bytes at most (ValueError otherwise; FileNotFoundError).
    Not :mod:`agentcell.hostfs`: root's own appends take a trail path that is not UTF-8 too."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return os.read(fd, 256).decode("ascii")
    finally:
        os.close(fd)


def _read_head(path: str) -> tuple[int, str] | None:
    try:
        seq, digest = _head_text(path).split()
        return int(seq), digest
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # a link, a FIFO, not text: damaged
        return (-1, "")


HEAD_SIZE = 128  # the anchor's fixed size ("seq digest", padded): rewriting it never needs a new block


def _write_head(path: str, seq: int, digest: str) -> None:
    """Replace the anchor atomically, through a spare made after the last write (its inode and its
    block already allocated): an agent that uses up the file system's inodes (root has no reserve of
    them) cannot make the record of its own escape attempt fail at the anchor. A spare that is not a
    plain file of ours (a FIFO, a link, a hard link) is not used: a new file is, as the first time."""
    spare, target = path + ".spare", None
    try:
        fd = os.open(spare, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
            target = spare
        else:
            os.close(fd)
    except OSError:
        pass
    if target is None:
        target = f"{path}.tmp-{os.urandom(6).hex()}"
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        data = f"{seq} {digest}\n".encode().ljust(HEAD_SIZE)
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(28, "short write of the anchor (no space left on device?)")
        os.ftruncate(fd, len(data))
        os.fsync(fd)
        os.rename(target, path)
    except OSError:
        if target != spare:
            try:
                os.unlink(target)
            except OSError:
                pass
        raise
    finally:
        os.close(fd)
    _make_spare(spare)


def _make_spare(spare: str) -> None:
    """The next anchor's file, made now while there is room, put in place by a rename (whatever is at
    the name goes). Best effort: without it the next write makes its own, as the first one did. Not
    synced: its inode exists and its block is reserved once written (what the next anchor needs), and
    its content is never read (the next anchor writes and syncs its own); a spare a crash lost is
    made again. (A sync here was a third per record.)"""
    tmp = f"{spare}.tmp-{os.urandom(6).hex()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.write(fd, b" " * HEAD_SIZE)
        os.rename(tmp, spare)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    finally:
        os.close(fd)


class Verdict:
    """What :func:`verify` found: ``problems`` (line number, what), empty when the chain is whole, and the
    sessions whose trail has no ``session.end`` (running, or ended without it: a supervisor killed,
    a log that filled)."""

    def __init__(self, path: str, records: int, problems: list[tuple[int, str]],
                 unfinished: list[str] | None = None) -> None:
        self.path, self.records, self.problems = path, records, problems
        self.unfinished = unfinished or []

    @property
    def ok(self) -> bool:
        return not self.problems


def _open_trail(path: str) -> int | None:
    """The trail, as a file named by a user must be read (a regular file, no link, no FIFO); None if it
    does not exist."""
    from ..hostfs import open_regular

    if not os.path.lexists(path):
        return None
    return open_regular(path, path, "give the audit trail's file (a regular file)")


def _upto(f: Any, size: int) -> Iterator[bytes]:
    """The lines of ``f`` within its first ``size`` bytes."""
    left = size
    for raw in f:
        if left <= 0:
            return
        if len(raw) > left:
            yield raw[:left]
            return
        left -= len(raw)
        yield raw


def _finished_size(fd: int) -> int:
    """The open trail's length while no writer holds its lock: what its writers had finished."""
    _lock(fd, fcntl.LOCK_SH)
    try:
        return os.fstat(fd).st_size
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def committed_size(path: str) -> int:
    """The trail's length as its writers had finished it (0 if there is none): where the next record
    will begin, for :func:`verify` and :func:`records` ``since``."""
    fd = _open_trail(path)
    if fd is None:
        return 0
    try:
        return _finished_size(fd)
    finally:
        os.close(fd)


def _before(fd: int, since: int) -> tuple[str, int]:
    """The chain's state at byte ``since``: the digest and sequence number of the record that ends there
    (``since`` 0: the genesis). ValueError if no record ends there."""
    if since == 0:
        return GENESIS, 0
    if os.pread(fd, 1, since - 1) != b"\n":
        raise ValueError(f"no record ends at byte {since}")
    line = _last_line(fd, since)
    rec = json.loads(line)
    if not isinstance(rec, dict) or not isinstance(rec.get("seq"), int) or rec["seq"] < 1:
        raise ValueError(f"the record before byte {since} has no sequence number")
    return _digest(line), int(rec["seq"])


def verify(path: str | None = None, since: int = 0) -> Verdict:
    """The chain checked from byte ``since`` (0: the whole trail; else where a record began, as
    :func:`committed_size` said then) to its end and its anchor: each record after ``since`` follows the
    one before it, the first of them the record that ends at ``since``. What lies before ``since`` is not
    read: a fleet node checks each session's part as it ends (the records from where the trail ended as
    the session began), not its whole history each time; ``agentcell audit verify`` reads it all."""
    path = path or default_path()
    problems: list[tuple[int, str]] = []
    fd = _open_trail(path)
    if fd is None:
        return Verdict(path, 0, [(0, f"{path} does not exist")])
    started: dict[str, int] = {}
    ended: set[str] = set()
    line = b""
    try:
        prev, seq = _before(fd, since) if since <= os.fstat(fd).st_size else (GENESIS, 0)
    except (OSError, ValueError, RecursionError) as e:
        os.close(fd)
        return Verdict(path, 0, [(0, f"the trail cannot be read from byte {since}: {e} (edited or replaced)")])
    n = seq
    with os.fdopen(fd, "rb") as f:
        # What a writer has finished: the length and the anchor together, read while no one appends (a
        # writer holds the lock from its record's write to its anchor's), then the records up to there.
        # Records appended meanwhile are past that length: a live trail verifies as it stood.
        try:
            _lock(fd, fcntl.LOCK_SH)
        except OSError as e:
            return Verdict(path, 0, [(0, str(e))])
        try:
            size = os.fstat(fd).st_size
            head: str | Exception = _head_text(path + ".head")
        except (OSError, ValueError) as e:
            head = e
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        if since > size:
            return Verdict(path, 0, [(0, f"the trail is {size} bytes, shorter than the {since} it had "
                                        "(truncated or replaced)")])
        f.seek(since)
        for n, raw in enumerate(_upto(f, size - since), seq + 1):  # streamed: any length, bounded memory
            if not raw.endswith(b"\n"):
                problems.append((n, "the last record is cut off in the middle (truncated)"))
                n -= 1
                break
            line = raw[:-1]
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not an object")
                canonical = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
            except (ValueError, RecursionError):  # RecursionError: a line of nested brackets
                problems.append((n, "not a JSON record (edited or inserted)"))
                prev, seq = _digest(line), seq + 1
                continue
            if canonical != line:
                problems.append((n, "not written by agentcell as it is now (edited)"))
            if rec.get("prev") != prev:
                problems.append((n, f"does not follow record {n - 1}: that one was edited, or a record was inserted, "
                                    "removed or moved here"))
            if rec.get("seq") != seq + 1:
                problems.append((n, f"sequence {rec.get('seq')} where {seq + 1} was expected (records removed, "
                                    "inserted or reordered)"))
            prev = _digest(line)
            seq = rec["seq"] if isinstance(rec.get("seq"), int) else seq + 1
            sid, event = str(rec.get("session") or ""), str(rec.get("event") or "")
            if sid and event.startswith("session."):
                started.setdefault(sid, n)
                if event == "session.end":
                    ended.add(sid)
    lines = n
    try:
        if isinstance(head, Exception):
            raise head
        head_seq, head_digest = head.split()
        if int(head_seq) > lines:
            problems.append((lines, f"the log ends at record {lines} but {head_seq} were written (truncated)"))
        elif int(head_seq) == lines and head_digest != prev:
            problems.append((lines, "the last record is not the one written last (replaced)"))
        elif int(head_seq) < lines:
            problems.append((int(head_seq) + 1, "records after the last one written (appended by hand)"))
    except FileNotFoundError:
        if lines:
            problems.append((0, f"{path}.head is missing: truncation cannot be ruled out"))
    except (OSError, ValueError):
        problems.append((0, f"{path}.head is damaged"))
    return Verdict(path, lines, problems, [sid for sid in started if sid not in ended])


def committed_lines(path: str) -> list[bytes]:
    """The trail's whole lines (without their newlines) as its writers had finished them: read up to the
    length the file had while no writer held the lock. A missing trail has none."""
    fd = _open_trail(path)
    if fd is None:
        return []
    with os.fdopen(fd, "rb") as f:
        return [raw[:-1] for raw in _upto(f, _finished_size(fd)) if raw.endswith(b"\n")]


def records(path: str | None = None, session: str | None = None, since: int = 0) -> list[dict[str, Any]]:
    """The records that parse (verify first to know the trail is whole), optionally one session's, from
    byte ``since`` on (where a record began)."""
    out: list[dict[str, Any]] = []
    fd = _open_trail(path or default_path()) if since >= 0 else None
    if fd is None:
        return out
    with os.fdopen(fd, "rb") as f:
        f.seek(since)
        for line in f:
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict) and (session is None or rec.get("session") == session):
                out.append(rec)
    return out
