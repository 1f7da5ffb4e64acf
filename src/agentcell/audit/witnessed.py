"""The trail checked against its witness, offline: ``agentcell audit verify --witness W --key K``.

1. **The heads.** The witness's heads of the log K names (:func:`.seal.log_id`) are followed epoch by
   epoch from K: each must be signed by its epoch's key (epoch 0's is K; epoch k+1's is the ``next_key``
   epoch k's head names), start where the previous one ended, carry an RFC 6962 consistency proof from
   the previous head's tree to its own that verifies against both signed roots (RFC 9162 §2.1.4.2), and
   leaf hashes that reproduce its signed root. A head no key of the chain signed (forged by whoever
   could write to the witness), two different heads for one epoch (its key was used after it was to be
   erased: taken from the host), an epoch the witness lacks (the later keys cannot be checked without
   it): each is a problem, and the chain is checked up to there only.
2. **The trail.** Its records' leaves are replayed into a compact range; at each head's size the root
   must be the head's signed root. Within the first head the trail does not reproduce, the first record
   whose leaf is not the one the witness holds is named, and proved: an RFC 6962 audit path from the
   witness's leaves shows the sealed leaf included in the signed head and the trail's not (RFC 9162
   §2.1.3.2). A trail shorter than a head names its first missing record.
3. **What no head covers yet** (records after the last witnessed head) is said: a running session's
   latest records; a problem unless ``running``: a root could have written them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from . import merkle, seal, trail, witness

HEX32, HEX64 = 64, 128


@dataclass
class Witnessed:
    witness: str
    log: str
    heads: list[dict[str, Any]] = field(default_factory=list)  # the chain that checked out, epoch by epoch
    records: int = 0  # the trail's
    problems: list[tuple[int, str]] = field(default_factory=list)  # (trail line, what), line 0: not a record
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def sealed(self) -> int:
        """Records the witnessed heads cover."""
        return int(self.heads[-1]["size"]) if self.heads else 0


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _hex(value: Any, length: int) -> bool:
    if not isinstance(value, str) or len(value) != length:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


def _well_formed(h: dict[str, Any]) -> bool:
    ints = all(isinstance(h.get(k), int) and not isinstance(h.get(k), bool) and h[k] >= 0
               for k in ("epoch", "from", "size"))
    return (ints and isinstance(h.get("ts"), (int, float)) and _hex(h.get("root"), HEX32)
            and _hex(h.get("key"), HEX32) and _hex(h.get("next_key"), HEX32) and _hex(h.get("sig"), HEX64)
            and isinstance(h.get("proof"), list) and all(_hex(p, HEX32) for p in h["proof"])
            and isinstance(h.get("leaves"), list) and all(_hex(x, HEX32) for x in h["leaves"]))


def check(path: str, witness_spec: str, key_text: str, *, running: bool = False) -> Witnessed:
    w = witness.parse(witness_spec, "--witness")
    public = seal.parse_key(key_text)
    out = Witnessed(str(w), seal.log_id(public))
    leaves = _chain(out, witness.heads_in(witness.read(w)), public)
    _trail(out, path, leaves, running)
    return out


def _chain(out: Witnessed, found: list[tuple[int, Any]], public: bytes) -> list[bytes]:
    """Follow the key chain through the witness's heads (into ``out``); the leaf hashes they hold."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    by_epoch: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for n, h in found:
        if not isinstance(h, dict) or h.get("log") != out.log:
            continue
        if not _well_formed(h):
            out.problems.append((0, f"{out.witness}: its line {n} holds a head of this trail that is not well-formed "
                                    "(damaged at the witness, or not made by agentcell)"))
            continue
        by_epoch.setdefault(h["epoch"], []).append((n, h))
    if not by_epoch:
        out.problems.append((0, f"{out.witness} holds no head of this trail (log {out.log}): it was never sealed "
                                "to this witness with this key, or its heads never arrived"))
        return []
    last_epoch = max(by_epoch)
    key, size, root = public, 0, merkle.EMPTY_ROOT
    tree, leaves = merkle.CompactRange(), []
    for epoch in range(last_epoch + 1):
        good: dict[bytes, dict[str, Any]] = {}
        for n, h in by_epoch.get(epoch, []):
            try:
                if h["key"] != key.hex():
                    raise InvalidSignature
                Ed25519PublicKey.from_public_bytes(key).verify(bytes.fromhex(h["sig"]), seal.signed_bytes(h))
                good.setdefault(seal.signed_bytes(h), h)
            except InvalidSignature:
                out.problems.append((0, f"{out.witness}: its line {n} holds a head for epoch {epoch} that epoch "
                                        f"{epoch}'s key did not sign (forged by whoever could write to the witness)"))
        if len(good) > 1:
            spans = ", ".join(f"records {h['from'] + 1}-{h['size']}" for h in good.values())
            out.problems.append((0, f"epoch {epoch} was signed twice with different heads ({spans}): its key was "
                                    "used after it was to be erased, so it was taken from the host during that "
                                    f"epoch; nothing after epoch {epoch - 1} can be trusted"))
            break
        if not good:
            out.problems.append((0, f"{out.witness} holds no head of epoch {epoch} signed by its key, so the heads "
                                    f"of epochs {epoch + 1}-{last_epoch} cannot be checked (each epoch's key is "
                                    "named by the head before it): a head that never arrived, or was removed"))
            break
        h = next(iter(good.values()))
        new_root, new_leaves = bytes.fromhex(h["root"]), [bytes.fromhex(x) for x in h["leaves"]]
        tree.extend(new_leaves)
        why = ("it does not start where epoch " + str(epoch - 1) + "'s ended" if h["from"] != size else
               "it covers no record" if h["size"] <= size else
               "its leaves are not as many as its records" if len(new_leaves) != h["size"] - size else
               "its consistency proof from the previous head does not verify" if not merkle.verify_consistency(
                   size, h["size"], root, new_root, [bytes.fromhex(p) for p in h["proof"]]) else
               "its leaves do not reproduce its signed root" if tree.root() != new_root else "")
        if why:
            out.problems.append((0, f"{out.witness}: the head of epoch {epoch} (records {h['from'] + 1}-{h['size']}) "
                                    f"is signed, but {why}: damaged at the witness"))
            break
        out.heads.append(h)
        leaves += new_leaves
        key, size, root = bytes.fromhex(h["next_key"]), h["size"], new_root
    return leaves


def _trail(out: Witnessed, path: str, sealed: list[bytes], running: bool) -> None:
    """The trail's records against the chain's heads (into ``out``)."""
    lines = trail.committed_lines(path)
    local = [merkle.leaf_hash(line) for line in lines]
    out.records = count = len(local)
    tree, pos = merkle.CompactRange(), 0
    for h in out.heads:
        size, root = int(h["size"]), bytes.fromhex(h["root"])
        tree.extend(local[pos:min(size, count)])
        pos = min(size, count)
        if size <= count and tree.root() == root:
            continue
        sealed_at = f"epoch {h['epoch']}'s head ({when(h['ts'])})"
        first = next((j for j in range(int(h["from"]), min(size, count)) if local[j] != sealed[j]), None)
        if first is not None:
            proof = merkle.inclusion_proof(first, size, merkle.over(sealed[:size]))
            assert merkle.verify_inclusion(first, size, sealed[first], proof, root)  # (the replay checked them)
            assert not merkle.verify_inclusion(first, size, local[first], proof, root)
            more = sum(1 for j in range(first + 1, min(out.sealed, count)) if local[j] != sealed[j])
            rechained = " (and the chain after it recomputed)" if trail.verify(path).ok else ""
            out.problems.append((first + 1, f"record {first + 1} is not the one {sealed_at} sealed: it was changed "
                                            f"after it was sealed{rechained}" +
                                            (f"; {more} more sealed record(s) differ after it" if more else "")))
        if count < out.sealed:
            out.problems.append((count + 1, f"records {count + 1}-{out.sealed} are missing: the witness holds heads "
                                            f"of {out.sealed} records, the trail has {count} (cut off after they "
                                            "were sealed)"))
        return
    if count > out.sealed:
        try:
            st = seal.status(path)
        except (OSError, seal.SealError):
            st = None
        waiting = f"; {len(st.undelivered)} head(s) wait on this host for the witness" if st and st.undelivered \
            else ""
        text = (f"records {out.sealed + 1}-{count} are not covered by a head the witness holds{waiting}: a root "
                "could have written them")
        if running:
            out.notes.append(text + " (--running: the latest records of running sessions)")
        else:
            out.problems.append((out.sealed + 1, text + "; --running accepts them while a session runs"))
