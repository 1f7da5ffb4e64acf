"""Sealing the audit trail: signed tree heads over its records, sent off the host at once, signed by a
key that only moves forward.

The chain (:mod:`.trail`) stops at root: whoever owns the host later can rewrite the file and recompute
every hash. A sealed trail also has, beside it in ``<trail>.seal/`` (root's, 0700), an RFC 6962 Merkle tree
over its records (:mod:`.merkle`; a leaf is a record's line) kept as a compact range, and a key. Every
``every`` records, or once ``interval`` seconds have passed at an append (a running session appends a
``session.tick`` every 15 s), at each session's end, and on ``agentcell audit seal``, the sealer signs a
**tree head** (the tree's size and root) and sends it to the trail's **witness** (:mod:`.witness`), a sink
off the host that keeps what it is sent. A head covers at most ``every`` new records: more are sealed as
several heads. Each head carries, unsigned, the RFC 6962 consistency proof from the previous head and the
leaf hashes of the records it adds (hashes only, no record's content), so that ``verify`` can name the
first record that no longer matches.

The forward-secure key is a chain of Ed25519 keys (``cryptography``'s; nothing here is a primitive), one
per epoch, and **each epoch's key signs exactly one statement**: the head of its epoch (log id, epoch,
first and last record, root, time, its own public key) *and the public key of the next epoch*. Then it is
erased: the state file that held it is replaced by one holding the next epoch's key, and the old file's
bytes, already unlinked, are overwritten with zeros and synced. The verifier needs only epoch 0's public
key (printed once by ``agentcell audit init``, kept off the host) and follows the chain head by head.

What that proves. A root who takes the host during epoch k finds key k and no earlier one: it can sign
heads for epoch k and later only, and each must extend the tree of epoch k-1's head (the consistency
proof, and the leaves, are checked), which the witness already holds. So every record a head *delivered
to the witness* covers is fixed: rewriting, removing, re-chaining or truncating it after the fact is
caught by ``agentcell audit verify --witness W --key K``, which names the first record that differs. It
does not fix the records after the last delivered head: at most ``every`` records or ``interval``
seconds' worth, plus whatever waited while the witness was unreachable (heads that could not be sent
stay queued here, in order, and go out first at the next seal; a root can drop that queue, which
``verify`` reports as missing epochs, never as a valid trail). Nor does it stop a root from appending
records and heads of its own from epoch k on, or from stopping the sealing: a trail whose last witnessed
head is old says so.

Limits of the erasure: on a journaling or copy-on-write file system, or an SSD, the old key's bytes may
survive on the medium after the overwrite; and the key is in the sealing process's memory while it signs.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass
from typing import Any

from .. import hostfs
from . import merkle
from .base import AuditWriteError, fsync_dir, lock

DEFAULT_EVERY = 64  # records per head at most
DEFAULT_INTERVAL_S = 30.0
MAX_EVERY = 512  # a head's leaves (~66 bytes each) stay within a UDP syslog datagram
KEY_PREFIX = "ed25519:"
CONTEXT = b"agentcell tree head v1\n"  # what a head's signature covers starts so: the key signs nothing else
SIGNED = ("agentcell_head", "log", "epoch", "from", "size", "root", "ts", "key", "next_key")
STATE, SENT, PROBLEM, SEND_LOCK = "state", "sent", "problem", "send.lock"
SEND_WAIT_S = 30.0  # another process delivering longer than this is a witness that does not answer
META = ("log", "epoch", "size", "offset", "last", "range", "ts", "every", "interval", "witness")


class SealError(AuditWriteError):
    """The seal cannot go on (its state damaged, the trail changed under it): the record itself was written."""


def seal_dir(trail: str) -> str:
    return trail + ".seal"


def is_sealed(trail: str) -> bool:
    return os.path.isdir(seal_dir(trail))


def log_id(public: bytes) -> str:
    """The log a witness files heads under: from epoch 0's key, so that ``--key`` picks its heads."""
    return hashlib.sha256(b"agentcell log\n" + public).hexdigest()[:32]


def parse_key(text: str, field: str = "--key") -> bytes:
    """Epoch 0's public key as ``init`` printed it (``ed25519:`` and 64 hex digits), or a file holding it."""
    from ..errors import AgentcellError

    value = text.strip()
    if not value.startswith(KEY_PREFIX) and os.path.isfile(value):
        from ..hostfs import open_regular, read_fd

        fd = open_regular(value, field, "give the key itself, or a file holding it")
        try:
            value = read_fd(fd, value, field, "give the key itself, or a file holding it", 4096).decode(
                "ascii", "replace").strip()
        finally:
            os.close(fd)
    raw = value.removeprefix(KEY_PREFIX)
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if not value.startswith(KEY_PREFIX) or len(key) != 32:
        raise AgentcellError(field, f"'{value[:80]}' is not a trail's key", "give the key 'agentcell audit init' "
                             "printed: ed25519: and 64 hex digits (or a file holding it)")
    return key


def signed_bytes(head: dict[str, Any]) -> bytes:
    return CONTEXT + json.dumps({k: head.get(k) for k in SIGNED}, sort_keys=True, separators=(",", ":"),
                                ensure_ascii=True).encode()


# ---- the state: <trail>.seal/state -----------------------------------------------------------------
#
# line 1: the meta (what the due check reads: log, epoch, what was sealed, when, the settings)
# line 2: the current epoch's private key (hex of its 32 bytes), the one that signs the next head
# after: the heads signed but not yet delivered (sent: the last epoch the witness took)

@dataclass
class State:
    meta: dict[str, Any]
    key: str
    pending: list[dict[str, Any]]


def _damaged(d: str, why: str) -> SealError:
    return SealError("audit", f"the seal of the trail ({d}) is damaged: {why}",
                     "nothing more is sealed: 'agentcell audit verify --witness … --key …' says what changed")


def _open_ours(path: str, d: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise _damaged(d, f"{path} is not a file of ours that only we can read")
    return fd


def _check_meta(meta: Any, d: str) -> dict[str, Any]:
    if not isinstance(meta, dict) or any(k not in meta for k in META):
        raise _damaged(d, "its state names no seal")
    return meta


def read_meta(d: str) -> dict[str, Any]:
    """The first line of the state: what the due check at every append needs, without the queue."""
    fd = _open_ours(os.path.join(d, STATE), d)
    try:
        first = os.read(fd, 65536).split(b"\n", 1)[0]
    finally:
        os.close(fd)
    try:
        return _check_meta(json.loads(first), d)
    except (ValueError, RecursionError):
        raise _damaged(d, "its state is not JSON") from None


def _read_state(d: str) -> State:
    fd = _open_ours(os.path.join(d, STATE), d)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    finally:
        os.close(fd)
    lines = data.split(b"\n")
    try:
        meta = _check_meta(json.loads(lines[0]), d)
        key = lines[1].decode("ascii")
        pending = [json.loads(line) for line in lines[2:] if line]
        if len(bytes.fromhex(key)) != 32:
            raise ValueError
    except (ValueError, IndexError, RecursionError, UnicodeDecodeError):
        raise _damaged(d, "its state is not what the sealer wrote") from None
    return State(meta, key, pending)


def _write_state(d: str, st: State) -> None:
    """Replace the state, then erase the old one: its bytes (the previous epoch's key) overwritten with
    zeros and synced, after the new state is in place and synced (a crash in between leaves the new
    state whole, and the old bytes, unlinked, to the file system)."""
    path = os.path.join(d, STATE)
    try:
        old: int | None = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        old = None
    data = b"\n".join([json.dumps(st.meta, sort_keys=True, separators=(",", ":")).encode(), st.key.encode(),
                       *(json.dumps(h, sort_keys=True, separators=(",", ":")).encode() for h in st.pending)]) + b"\n"
    try:
        _replace(path, data)
        if old is not None:
            size = os.fstat(old).st_size
            os.pwrite(old, b"\0" * size, 0)
            os.fsync(old)
    finally:
        if old is not None:
            os.close(old)


def _replace(path: str, data: bytes) -> None:
    """Whole or not at all, and the directory synced after (:func:`agentcell.hostfs.replace_file`)."""
    hostfs.replace_file(path, data)
    fsync_dir(os.path.dirname(path))


def _read_sent(d: str) -> int:
    try:
        fd = _open_ours(os.path.join(d, SENT), d)
    except FileNotFoundError:
        return -1
    try:
        return int(os.read(fd, 64).decode("ascii").strip() or -1)
    except (ValueError, UnicodeDecodeError):
        raise _damaged(d, "its record of the heads delivered is not a number") from None
    finally:
        os.close(fd)


# ---- making a seal ---------------------------------------------------------------------------------

def init(trail: str, witness_spec: str, every: int = DEFAULT_EVERY, interval: float = DEFAULT_INTERVAL_S,
         field: str = "--witness") -> tuple[str, str]:
    """Set up the seal of ``trail`` (its witness, its epoch 0 key); (epoch 0's public key as text, log id).
    The first head is made by the next append (the caller's ``audit.seal`` record)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ..errors import AgentcellError
    from .witness import parse

    w = parse(witness_spec, field)
    if not 0 < every <= MAX_EVERY:
        raise AgentcellError("--every", f"{every} is not between 1 and {MAX_EVERY}", "e.g. --every 64")
    if not 0 < interval <= 86400:
        raise AgentcellError("--interval", f"{interval:g} is not between 0 and 86400 seconds", "e.g. --interval 30")
    d = seal_dir(trail)
    if os.path.lexists(d):
        raise AgentcellError("FILE", f"{trail} is sealed already ({d})", "'agentcell audit verify --witness … --key "
                             "…' checks it; a new key needs a new trail")
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes_raw()
    meta = {"v": 1, "log": log_id(public), "epoch": 0, "size": 0, "offset": 0, "last": "", "range": [], "ts": 0,
            "every": every, "interval": interval, "witness": str(w)}
    tmp = f"{d}.tmp-{os.urandom(6).hex()}"
    os.mkdir(tmp, 0o700)
    try:
        _replace(os.path.join(tmp, STATE), json.dumps(meta, sort_keys=True, separators=(",", ":")).encode() + b"\n"
                 + key.private_bytes_raw().hex().encode() + b"\n")
        os.rename(tmp, d)  # (a directory that appeared meanwhile is not replaced: rename fails on it)
    except OSError:
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
        raise
    fsync_dir(os.path.dirname(d) or ".")
    return KEY_PREFIX + public.hex(), str(meta["log"])


def due(trail: str, seq: int) -> bool:
    """Whether an append that made record ``seq`` should seal (the cheap check made at every append)."""
    meta = read_meta(seal_dir(trail))
    return seq - int(meta["size"]) >= int(meta["every"]) or time.time() - float(meta["ts"]) >= float(meta["interval"])


def seal(trail: str, *, force: bool) -> list[dict[str, Any]]:
    """Sign heads over the records not sealed yet (all of them with ``force``; else whole batches of
    ``every``, and the rest once ``interval`` has passed), under the trail's lock; queue them for the
    witness. The heads made."""
    d = seal_dir(trail)
    fd = os.open(trail, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        lock(fd)
        st = _read_state(d)
        sent = _read_sent(d)
        heads = _seal_locked(fd, d, st, force)
        if heads:
            st.pending = [h for h in st.pending if int(h.get("epoch", -1)) > sent] + heads
            _write_state(d, st)
        return heads
    finally:
        os.close(fd)  # releases the lock


def _unsealed(fd: int, d: str, meta: dict[str, Any]) -> list[bytes]:
    """The whole records after what was sealed, checked to go on from it."""
    size, offset = int(meta["size"]), int(meta["offset"])
    end = os.fstat(fd).st_size
    if end < offset:
        raise _damaged(d, f"the trail is {end:,} bytes, shorter than the {offset:,} already sealed (cut after sealing)")
    chunks, pos = [], offset
    while pos < end:
        chunk = os.pread(fd, min(1 << 20, end - pos), pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    lines = b"".join(chunks).split(b"\n")[:-1]  # (a last line without its newline is not a record yet)
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
            seq, prev = rec["seq"], rec["prev"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise _damaged(d, f"record {size + i + 1} is not a record") from None
        if seq != size + i + 1 or (i == 0 and size and prev != meta["last"]):
            raise _damaged(d, f"record {size + i + 1} does not follow the {size} sealed (the sealed records were "
                           "changed, or records removed or inserted)")
    return lines


def _seal_locked(fd: int, d: str, st: State, force: bool) -> list[dict[str, Any]]:
    meta = st.meta
    lines = _unsealed(fd, d, meta)
    every = int(meta["every"])
    rest_too = force or time.time() - float(meta["ts"]) >= float(meta["interval"])
    heads: list[dict[str, Any]] = []
    while lines and (len(lines) >= every or rest_too):
        batch, lines = lines[:every], lines[every:]
        leaves = [merkle.leaf_hash(line) for line in batch]
        old = merkle.CompactRange(int(meta["size"]), (bytes.fromhex(h) for h in meta["range"]))
        proof = merkle.consistency_proof(old.size, old.size + len(leaves), merkle.extended(old, leaves)) \
            if old.size else []
        new = merkle.CompactRange(old.size, old.nodes)
        new.extend(leaves)
        head = _sign(st, old.size, new, leaves, proof)
        meta.update(epoch=int(meta["epoch"]) + 1, size=new.size, ts=head["ts"], range=[n.hex() for n in new.nodes],
                    offset=int(meta["offset"]) + sum(len(line) + 1 for line in batch),
                    last=hashlib.sha256(batch[-1]).hexdigest())
        heads.append(head)
    return heads


def _sign(st: State, old: int, new: merkle.CompactRange, leaves: list[bytes], proof: list[bytes]) -> dict[str, Any]:
    """The head of the current epoch, signed by its key, which names the next epoch's key and is then
    dropped (``st.key`` becomes the next one; :func:`_write_state` erases it from the disk)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(st.key))
    nxt = Ed25519PrivateKey.generate()
    head: dict[str, Any] = {
        "agentcell_head": 1, "log": st.meta["log"], "epoch": int(st.meta["epoch"]), "from": old, "size": new.size,
        "root": new.root().hex(), "ts": round(time.time(), 3), "key": key.public_key().public_bytes_raw().hex(),
        "next_key": nxt.public_key().public_bytes_raw().hex()}
    head["sig"] = key.sign(signed_bytes(head)).hex()
    head["proof"] = [p.hex() for p in proof]
    head["leaves"] = [leaf.hex() for leaf in leaves]
    st.key = nxt.private_bytes_raw().hex()
    return head


# ---- delivering ------------------------------------------------------------------------------------

def deliver(trail: str) -> str | None:
    """Send the queued heads to the witness, oldest first, stopping at the first it does not take; None
    when all are delivered, else what went wrong (kept in ``<trail>.seal/problem`` too)."""
    from .witness import parse, send

    d = seal_dir(trail)
    lfd = os.open(os.path.join(d, SEND_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + SEND_WAIT_S  # (one sender at a time: each sends what is queued, in order)
        while True:
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return (f"another process has been sending heads to the witness for {SEND_WAIT_S:g} s: it does "
                            "not answer")
                time.sleep(0.02)
        st, sent = _read_state(d), _read_sent(d)
        w = parse(str(st.meta["witness"]), "the seal's witness")
        for head in sorted(st.pending, key=lambda h: int(h["epoch"])):
            epoch = int(head["epoch"])
            if epoch <= sent:
                continue
            try:
                send(w, head)
            except Exception as e:  # noqa: BLE001 - whatever the witness did, the head stays queued
                problem = (f"the witness {w} did not take the head of epoch {epoch} (records {head['from'] + 1}-"
                           f"{head['size']}): {e}")
                _replace(os.path.join(d, PROBLEM), f"{time.time():.3f} {problem}\n".encode())
                return problem
            _replace(os.path.join(d, SENT), f"{epoch}\n".encode())
            sent = epoch
        try:
            os.unlink(os.path.join(d, PROBLEM))
        except FileNotFoundError:
            pass
        return None
    finally:
        os.close(lfd)


@dataclass(frozen=True)
class Status:
    log: str
    witness: str
    epoch: int  # the next head's
    sealed: int  # records the heads cover
    every: int
    interval: float
    undelivered: list[tuple[int, int, int]]  # (epoch, first record, last record) of heads the witness lacks
    problem: str | None  # the last delivery's failure
    last_ts: float


def status(trail: str) -> Status | None:
    """The seal as this host knows it (None: the trail is not sealed). Root's view: a later root may lie."""
    d = seal_dir(trail)
    if not os.path.isdir(d):
        return None
    st, sent = _read_state(d), _read_sent(d)
    problem = None
    try:
        fd = _open_ours(os.path.join(d, PROBLEM), d)
        try:
            problem = os.read(fd, 4096).decode("utf-8", "replace").strip().partition(" ")[2] or None
        finally:
            os.close(fd)
    except FileNotFoundError:
        pass
    left = [(int(h["epoch"]), int(h["from"]) + 1, int(h["size"])) for h in st.pending if int(h["epoch"]) > sent]
    m = st.meta
    return Status(str(m["log"]), str(m["witness"]), int(m["epoch"]), int(m["size"]), int(m["every"]),
                  float(m["interval"]), sorted(left), problem, float(m["ts"]))
