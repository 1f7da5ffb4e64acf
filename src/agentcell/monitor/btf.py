"""The running kernel's own description of its types (BTF, ``/sys/kernel/btf/vmlinux``): where a member
lies in a kernel structure, so an eBPF program can read it on this kernel without its headers (they are
not shipped here). Only what :mod:`agentcell.monitor.calls` needs: a member's byte offset.

The types are read in order and the reading stops at the wanted structure: the core structures come
early (``linux_binprm`` is among the first two thousand of some hundred thousand types), a few
milliseconds. No library fits: libbpf's CO-RE relocates an object compiled by clang; bcc needs headers.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable

VMLINUX = "/sys/kernel/btf/vmlinux"
_MAGIC = 0xEB9F
KIND_STRUCT, KIND_UNION = 4, 5
# bytes that follow a type's 12-byte head: a fixed part, and a part per vlen entry (by kind)
_FIXED = {1: 4, 3: 12, 14: 4, 17: 4}  # INT, ARRAY, VAR, DECL_TAG
_EACH = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}  # STRUCT, UNION, ENUM, FUNC_PROTO, DATASEC, ENUM64


def member_offset(struct_name: str, member: str, path: str = VMLINUX) -> int | None:
    """The byte offset of ``member`` in ``struct struct_name``, or None (no BTF, no such structure or
    member, or a bit field)."""
    return offsets(((struct_name, member),), path)[(struct_name, member)]


def offsets(wanted: Iterable[tuple[str, str]], path: str = VMLINUX) -> dict[tuple[str, str], int | None]:
    """:func:`member_offset` for each (structure, member) of ``wanted``, the file read once (about 5 MB,
    not kept)."""
    wanted = tuple(wanted)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        data = b""
    if len(data) < 24 or struct.unpack_from("<H", data, 0)[0] != _MAGIC:
        return dict.fromkeys(wanted)
    _magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data, 0)
    types = memoryview(data)[hdr_len + type_off:hdr_len + type_off + type_len]
    strings = data[hdr_len + str_off:hdr_len + str_off + str_len]
    return {(name, member): _offset(types, strings, name, member) for name, member in wanted}


def _offset(types: memoryview, strings: bytes, struct_name: str, member: str) -> int | None:
    wanted = _string_offsets(strings, struct_name.encode())
    if not wanted:
        return None
    pos, unpack = 0, struct.unpack_from
    while pos + 12 <= len(types):
        name_off, info, _size = unpack("<III", types, pos)
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        if kind == KIND_STRUCT and name_off in wanted:
            bitfields = bool(info >> 31)
            for i in range(vlen):
                m_name, _m_type, m_off = unpack("<III", types, pos + 12 + 12 * i)
                if _string(strings, m_name) == member:
                    bits = m_off & 0xFFFFFF if bitfields else m_off
                    return bits // 8 if bits % 8 == 0 else None
            return None
        pos += 12 + _FIXED.get(kind, 0) + _EACH.get(kind, 0) * vlen
    return None


def _string_offsets(strings: bytes, name: bytes) -> set[int]:
    """Where ``name`` stands as a whole string in the string section (it may stand more than once)."""
    out, at = set(), 0
    if strings.startswith(name + b"\0"):
        out.add(0)
    while (at := strings.find(b"\0" + name + b"\0", at)) >= 0:
        out.add(at + 1)
        at += 1
    return out


def _string(strings: bytes, off: int) -> str:
    end = strings.find(b"\0", off)
    return strings[off:end if end >= 0 else len(strings)].decode(errors="replace")
