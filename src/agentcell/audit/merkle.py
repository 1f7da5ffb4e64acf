"""RFC 6962 Merkle trees over the audit trail's records: the hashes, a compact range, inclusion and
consistency proofs (RFC 6962 §2.1, verified as RFC 9162 §2.1.3.2 and §2.1.4.2 say).

A leaf is a record's line, its exact bytes without the newline: ``SHA-256(0x00 || line)``; a node is
``SHA-256(0x01 || left || right)``; a tree of n > 1 leaves splits at k, the largest power of two below n
(``MTH(D[n]) = node(MTH(D[0:k]), MTH(D[k:n]))``); the empty tree's hash is ``SHA-256("")``. SHA-256 is
:mod:`hashlib`'s: nothing here is a primitive, only the RFC's arrangement of one.

Proofs are made over a *view* of a tree: a function giving the hash of any range ``[a, b)`` the RFC's
algorithms ask for. :func:`over` is the view of a list of leaf hashes (the verifier, which holds them);
:func:`extended` is the view of a :class:`CompactRange` plus the leaves appended after it (the sealer,
which keeps only the range: O(log n) hashes however long the trail grows). The algorithms ask only for
ranges each view has: the RFC's PROOF(m, n) needs, on the old side, whole subtrees of the old tree's
compact range or a suffix of it, and on the new side ranges of new leaves.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

View = Callable[[int, int], bytes]  # (a, b) -> MTH(D[a:b])
EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


class CompactRange:
    """The roots of the perfect subtrees that make up the tree ``[0, size)`` (one per set bit of size,
    largest first): enough to append leaves and to compute the root, in O(log size) hashes."""

    def __init__(self, size: int = 0, nodes: Iterable[bytes] = ()) -> None:
        self.size, self.nodes = size, list(nodes)
        if len(self.nodes) != bin(size).count("1"):
            raise ValueError(f"a compact range of {size} leaves has {bin(size).count('1')} nodes, not "
                             f"{len(self.nodes)}")

    def append(self, leaf: bytes) -> None:
        self.nodes.append(leaf)
        self.size += 1
        s = self.size
        while not s & 1:  # each trailing zero of the new size: two subtrees of that height merge
            right = self.nodes.pop()
            self.nodes[-1] = node_hash(self.nodes[-1], right)
            s >>= 1

    def extend(self, leaves: Iterable[bytes]) -> None:
        for leaf in leaves:
            self.append(leaf)

    def root(self) -> bytes:
        if not self.nodes:
            return EMPTY_ROOT
        h = self.nodes[-1]
        for n in reversed(self.nodes[:-1]):  # the RFC's split, from the right: MTH(D[k:n]) first
            h = node_hash(n, h)
        return h

    def spans(self) -> list[tuple[int, int]]:
        """The leaf range each node covers, in order."""
        out, start = [], 0
        for bit in range(self.size.bit_length() - 1, -1, -1):
            if self.size >> bit & 1:
                out.append((start, start + (1 << bit)))
                start += 1 << bit
        return out


def root(leaves: Sequence[bytes]) -> bytes:
    """MTH of a list of leaf hashes."""
    r = CompactRange()
    r.extend(leaves)
    return r.root()


def over(leaves: Sequence[bytes]) -> View:
    """The view of a tree whose leaf hashes are all at hand."""
    def mth(a: int, b: int) -> bytes:
        if b - a == 1:
            return leaves[a]
        k = _split(b - a)
        return node_hash(mth(a, a + k), mth(a + k, b))
    return mth


def extended(old: CompactRange, new: Sequence[bytes]) -> View:
    """The view of the tree ``old`` extended by the leaf hashes ``new``, for the ranges a consistency
    proof from ``old.size`` asks for: new leaves, or whole nodes (or a suffix) of the old range."""
    m, spans, new_view = old.size, old.spans(), over(new)

    def mth(a: int, b: int) -> bytes:
        if a >= m:
            return new_view(a - m, b - m)
        if b <= m:
            picked = [n for (s, e), n in zip(spans, old.nodes, strict=True) if a <= s and e <= b]
            covered = sum(e - s for s, e in spans if a <= s and e <= b)
            if covered != b - a:
                raise ValueError(f"leaves {a}-{b} are not whole nodes of the compact range of {m}")
            h = picked[-1]
            for n in reversed(picked[:-1]):
                h = node_hash(n, h)
            return h
        k = _split(b - a)  # (a proof never asks for a range across m; the RFC's split is the answer)
        return node_hash(mth(a, a + k), mth(a + k, b))
    return mth


def inclusion_proof(index: int, size: int, view: View) -> list[bytes]:
    """RFC 6962 §2.1.1 PATH(index, D[size]): the siblings from the leaf up to the root."""
    if not 0 <= index < size:
        raise ValueError(f"leaf {index} is not in a tree of {size}")
    out, a, b = [], 0, size
    while b - a > 1:
        k = _split(b - a)
        if index < a + k:
            out.append(view(a + k, b))
            b = a + k
        else:
            out.append(view(a, a + k))
            a += k
    return out[::-1]


def consistency_proof(old: int, size: int, view: View) -> list[bytes]:
    """RFC 6962 §2.1.2 PROOF(old, D[size]): that the tree of ``old`` leaves is a prefix of this one."""
    if not 0 < old <= size:
        raise ValueError(f"no consistency proof from {old} to {size} leaves")

    def sub(m: int, a: int, b: int, whole: bool) -> list[bytes]:
        if m == b - a:
            return [] if whole else [view(a, b)]
        k = _split(b - a)
        if m <= k:
            return [*sub(m, a, a + k, whole), view(a + k, b)]
        return [*sub(m - k, a + k, b, False), view(a, a + k)]

    return sub(old, 0, size, True)


def root_from_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes | None:
    """RFC 9162 §2.1.3.2: the root a leaf and its path give, or None where the path cannot be one."""
    if not 0 <= index < size:
        return None
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return None
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return r if sn == 0 else None


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root_hash: bytes) -> bool:
    return root_from_inclusion(index, size, leaf, proof) == root_hash


def verify_consistency(old: int, size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]) -> bool:
    """RFC 9162 §2.1.4.2, with its trivial cases: an empty old tree is a prefix of any, and a tree of the
    same size is consistent only with the same root (and an empty proof)."""
    if old < 0 or old > size:
        return False
    if old == 0:
        return not proof
    if old == size:
        return not proof and old_root == new_root
    if not proof:
        return False
    path = list(proof)
    if old & (old - 1) == 0:  # an exact power of two: the old root is a node of the new tree
        path.insert(0, old_root)
    fn, sn = old - 1, size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root
