"""eBPF through bpf(2): a small assembler, maps, loading a program, attaching it to a raw tracepoint, and
reading a BPF ring buffer. No library fits: bcc compiles C with LLVM at every start and needs the
running kernel's headers (this kernel ships none: no CONFIG_IKHEADERS, no package); bpftrace spends
about a second in LLVM before its first event; libbpf loads an object that clang must have compiled
first. agentcell's one program is about a hundred instructions, assembled here and loaded and attached
in a few milliseconds with nothing but the kernel (:mod:`agentcell.monitor.calls`).

Every object made here (maps, the program, its link) belongs to the file descriptors that hold it: the
kernel frees it when the last one closes, so a supervisor that dies leaves nothing behind. Names (at
most 15 characters) start with ``agentcell``, as ``bpftool prog`` shows them.

Needs root (CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN) and, for the helpers that read memory, a kernel
whose lockdown is not ``confidentiality``.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine, -1)

# bpf(2) commands
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
PROG_LOAD, RAW_TRACEPOINT_OPEN = 5, 17
LINK_GET_FD_BY_ID = 30
# map and program types
MAP_HASH, MAP_ARRAY, MAP_PERCPU_ARRAY, MAP_HASH_OF_MAPS, MAP_RINGBUF = 1, 2, 6, 13, 27
NOEXIST = 1  # map_update: only a new key
PROG_RAW_TRACEPOINT = 17
# helpers (enum bpf_func_id)
MAP_LOOKUP = 1
KTIME_GET_NS = 5
GET_CURRENT_PID_TGID = 14
GET_CURRENT_COMM = 16
GET_CURRENT_TASK = 35
GET_CURRENT_CGROUP_ID = 80
PROBE_READ_USER = 112
PROBE_READ_KERNEL = 113
PROBE_READ_USER_STR = 114
PROBE_READ_KERNEL_STR = 115
RINGBUF_OUTPUT, RINGBUF_RESERVE, RINGBUF_SUBMIT, RINGBUF_DISCARD = 130, 131, 132, 133

# Registers: R0 return value, R1-R5 arguments (clobbered by calls), R6-R9 kept across calls, R10 frame.
R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10 = range(11)
# sizes for loads and stores
W, H, B, DW = 0x00, 0x08, 0x10, 0x18
_ALU = {"add": 0x00, "sub": 0x10, "mul": 0x20, "or": 0x40, "and": 0x50, "lsh": 0x60, "rsh": 0x70, "neg": 0x80,
        "mov": 0xB0}
_JMP = {"ja": 0x00, "jeq": 0x10, "jgt": 0x20, "jge": 0x30, "jset": 0x40, "jne": 0x50, "jsgt": 0x60, "jsge": 0x70,
        "jlt": 0xA0, "jle": 0xB0, "jslt": 0xC0, "jsle": 0xD0}


class BpfError(OSError):
    """A bpf(2) call failed; a refused program carries the end of the verifier's log."""


class Asm:
    """Instructions in order, with named jump targets: ``j("jeq", R0, "out", imm=0)`` … ``label("out")``."""

    def __init__(self) -> None:
        self._ins: list[tuple[int, int, int, int | str, int]] = []  # code, dst, src, offset or label, imm
        self._labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self._labels[name] = len(self._ins)

    def alu(self, op: str, dst: int, src: int | None = None, imm: int = 0) -> None:
        """64-bit ``dst op= src`` (a register), else ``dst op= imm``."""
        self._ins.append((0x07 | _ALU[op] | (0x08 if src is not None else 0), dst, src or 0, 0, imm))

    def ldx(self, size: int, dst: int, src: int, off: int) -> None:
        """``dst = *(size *)(src + off)``"""
        self._ins.append((0x01 | 0x60 | size, dst, src, off, 0))

    def stx(self, size: int, dst: int, off: int, src: int) -> None:
        """``*(size *)(dst + off) = src``"""
        self._ins.append((0x03 | 0x60 | size, dst, src, off, 0))

    def st(self, size: int, dst: int, off: int, imm: int) -> None:
        """``*(size *)(dst + off) = imm``"""
        self._ins.append((0x02 | 0x60 | size, dst, 0, off, imm))

    def atomic_add(self, dst: int, off: int, src: int) -> None:
        """``*(u64 *)(dst + off) += src``, atomically."""
        self._ins.append((0x03 | 0xC0 | DW, dst, src, off, 0))

    def j(self, op: str, dst: int, target: str, *, src: int | None = None, imm: int = 0) -> None:
        """``if dst op (src or imm) goto target`` (``ja``: always)."""
        self._ins.append((0x05 | _JMP[op] | (0x08 if src is not None else 0), dst, src or 0, target, imm))

    def call(self, helper: int) -> None:
        self._ins.append((0x05 | 0x80, 0, 0, 0, helper))

    def exit(self) -> None:
        self._ins.append((0x05 | 0x90, 0, 0, 0, 0))

    def ld64(self, dst: int, imm: int, *, map_fd: bool = False) -> None:
        """``dst = imm`` (64 bits); ``map_fd``: ``imm`` is a map's fd, which the kernel turns into the map."""
        self._ins.append((0x18, dst, 1 if map_fd else 0, 0, imm & 0xFFFFFFFF))
        self._ins.append((0, 0, 0, 0, (imm >> 32) & 0xFFFFFFFF))

    def code(self) -> bytes:
        out = bytearray()
        for i, (code, dst, src, off, imm) in enumerate(self._ins):
            if isinstance(off, str):
                off = self._labels[off] - i - 1
            out += struct.pack("<BBhi", code, (src << 4) | dst, off, imm - (1 << 32) if imm >= 1 << 31 else imm)
        return bytes(out)


def _bpf(cmd: int, attr: bytes) -> int:
    if SYS_BPF < 0:
        raise BpfError(38, f"bpf: not known on {os.uname().machine}")
    buf = ctypes.create_string_buffer(attr, len(attr))
    r = _libc.syscall(ctypes.c_long(SYS_BPF), ctypes.c_long(cmd), buf, ctypes.c_long(len(attr)))
    if r < 0:
        err = ctypes.get_errno()
        raise BpfError(err, f"bpf: {os.strerror(err)}")
    return int(r)


def _name(name: str) -> bytes:
    assert name.startswith("agentcell") and len(name) < 16, name
    return name.encode().ljust(16, b"\0")


def map_create(kind: int, key_size: int, value_size: int, entries: int, name: str, inner: int = 0) -> int:
    """A new map (close-on-exec fd); ``inner``: for a map of maps, a map like those it will hold."""
    attr = struct.pack("<7I", kind, key_size, value_size, entries, 0, inner, 0) + _name(name) + bytes(72)
    fd = _bpf(MAP_CREATE, attr)
    os.set_inheritable(fd, False)
    return fd


def map_update(fd: int, key: bytes, value: bytes, flags: int = 0) -> None:
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value, len(value))
    _bpf(MAP_UPDATE_ELEM, struct.pack("<IIQQQ", fd, 0, ctypes.addressof(k), ctypes.addressof(v), flags))


def map_keys(fd: int, key_size: int) -> list[bytes]:
    """The map's keys (a hash map's, in no particular order)."""
    out: list[bytes] = []
    nxt = ctypes.create_string_buffer(key_size)
    cur: Any = None
    while True:
        try:
            _bpf(MAP_GET_NEXT_KEY, struct.pack("<IIQQ", fd, 0, ctypes.addressof(cur) if cur is not None else 0,
                                                ctypes.addressof(nxt)) + bytes(8))
        except BpfError as e:
            if e.errno == 2:  # ENOENT: the last one
                return out
            raise
        out.append(nxt.raw)
        cur = ctypes.create_string_buffer(nxt.raw, key_size)


def map_delete(fd: int, key: bytes) -> None:
    k = ctypes.create_string_buffer(key, len(key))
    _bpf(MAP_DELETE_ELEM, struct.pack("<IIQ", fd, 0, ctypes.addressof(k)) + bytes(16))


def link_by_id(link_id: int) -> int:
    """A new fd on the link with this id (ENOENT once it is gone: detached, its last fd closed)."""
    fd = _bpf(LINK_GET_FD_BY_ID, struct.pack("<II", link_id, 0) + bytes(8))
    os.set_inheritable(fd, False)
    return fd


def object_id(fd: int) -> str:
    """What the bpf object behind ``fd`` is, by the kernel's id for it (``map_id:12``, ``link_id:3``), or
    empty if the fd is not one (from its fdinfo): an id is given once a boot."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("map_id", "link_id"):
                    return f"{key}:{value.strip()}"
    except OSError:
        pass
    return ""


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes:
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value_size)
    _bpf(MAP_LOOKUP_ELEM, struct.pack("<IIQQQ", fd, 0, ctypes.addressof(k), ctypes.addressof(v), 0))
    return v.raw


def prog_load(kind: int, code: bytes, name: str) -> int:
    """Load a program; a refusal raises :class:`BpfError` with the end of the verifier's log. The license
    must be GPL-compatible for the helpers that read memory; the program is written here, for this."""
    insns = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(b"Dual BSD/GPL")
    log = ctypes.create_string_buffer(1 << 20)

    def load(level: int) -> int:
        attr = struct.pack("<IIQQIIQII", kind, len(code) // 8, ctypes.addressof(insns), ctypes.addressof(lic),
                           level, len(log) if level else 0, ctypes.addressof(log) if level else 0, 0, 0)
        return _bpf(PROG_LOAD, attr + _name(name) + bytes(64))

    try:
        fd = load(0)
    except BpfError as e:
        try:  # again with the verifier's log, to say why
            load(1)
        except BpfError:
            pass
        lines = log.value.decode(errors="replace").strip().splitlines()
        tail = [ln for ln in lines if not ln.startswith(("cur state", "old state", "processed "))][-2:]
        raise BpfError(e.errno, f"bpf: the program was refused ({os.strerror(e.errno or 0)})"
                       + (f": {' | '.join(tail)}" if tail else "")) from None
    os.set_inheritable(fd, False)
    return fd


def attach_raw_tracepoint(name: str, prog_fd: int) -> int:
    """Attach to a raw tracepoint (``sys_exit``: every system call's return); detached when the fd closes."""
    n = ctypes.create_string_buffer(name.encode())
    fd = _bpf(RAW_TRACEPOINT_OPEN, struct.pack("<QI", ctypes.addressof(n), prog_fd) + bytes(4))
    os.set_inheritable(fd, False)
    return fd


_BUSY, _DISCARD = 1 << 31, 1 << 30


class RingBuffer:
    """The consumer's side of a BPF_MAP_TYPE_RINGBUF (``size``: a power of two, pages): poll its fd, then
    :meth:`records`."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        page = mmap.PAGESIZE
        self._page = page
        self._cons = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        try:  # the data pages are mapped twice in a row: a record that wraps reads as one piece
            self._prod = mmap.mmap(fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        except BaseException:
            self._cons.close()
            raise

    def fileno(self) -> int:
        return self.fd

    def records(self, limit: int) -> list[bytes]:
        """Up to ``limit`` committed records, oldest first (discarded ones are skipped); never blocks."""
        out: list[bytes] = []
        cons = struct.unpack_from("<Q", self._cons, 0)[0]
        prod = struct.unpack_from("<Q", self._prod, 0)[0]
        if cons >= prod:  # (nothing new: the consumer's position, shared with the kernel, is left alone)
            return out
        while cons < prod and len(out) < limit:
            at = self._page + (cons & (self.size - 1))
            head = struct.unpack_from("<I", self._prod, at)[0]
            if head & _BUSY:  # reserved, not yet submitted: it and what follows wait for the next read
                break
            length = head & ~(_BUSY | _DISCARD)
            if not head & _DISCARD:
                out.append(self._prod[at + 8:at + 8 + length])
            cons += (length + 8 + 7) & ~7
        struct.pack_into("<Q", self._cons, 0, cons)
        return out

    def close(self) -> None:
        self._cons.close()
        self._prod.close()
