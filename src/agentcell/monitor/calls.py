"""The cell's failed system calls, from the kernel: an eBPF program on the ``sys_exit`` raw tracepoint
(every call's return, host-wide) keeps only calls that failed, in the cell's own cgroup, of the calls
that reach for something (open, exec, connect, send, mkdir, unlink, rename, link, chmod, chdir, kill, …)
with an errno that can mean "not yours" (ENOENT, EACCES, EPERM, EROFS, EXDEV, EBUSY, ESRCH, and the
network's), and hands each to the monitor through a ring buffer with the process, its name and the
path or address it named. What it means is decided in :mod:`.attempts`. A second program, on the
``sched_process_exec`` raw tracepoint, hands over each exec of the cell (as errno 0), with the new
program's name and file (its place in the kernel's structure read from the kernel's BTF,
:mod:`.btf`): a process that exits at once is still named. Two more, on ``sched_process_fork`` and
``sched_process_exit``, hand over each task of the cell that starts or ends (threads too), with the
number it has in the cell's pid namespace, into a second ring of the cell's (:class:`TaskEvent`): a
/proc entry or a pid the cell names is then told to be one of the cell's own, or a host process's,
whatever the host's pids and the cell's pid counter are (:mod:`.pidns`). A flood of threads fills
that ring, never the calls'. Every event carries the kernel's clock (CLOCK_MONOTONIC).

Why this source: most of what a cell refuses, the kernel refuses without a record. A host file the cell
does not contain is ENOENT, a write to the read-only system EROFS (the mount refuses before Landlock is
asked), a datagram to the network ENETUNREACH (the cell's network namespace has no route), a host pid
ESRCH. Landlock's audit records cover only what exists in the cell and is not allowed.

Cost: the program runs at every system call's return on the host; one that succeeded costs two
instructions, one that failed in another cgroup a helper call more. Reading the path takes place at the call's
return: a thread of the same process could rewrite the buffer in between, so a path may be shown other
than it was asked for (the call failed all the same). x86_64 only (its call numbers and registers).
"""
from __future__ import annotations

import functools
import os
import socket
import struct
from typing import Any, NamedTuple

from . import bpf, hostprog

PATH_MAX = 4096  # a longer path fails with ENAMETOOLONG: nothing is reached
A = 96  # the first buffer: a path or an address
B = A + PATH_MAX  # the second: a second path, or a word the call points at (openat2's flags)
EVENT_SIZE = B + PATH_MAX
_HEAD = struct.Struct("<IIqQ6Q16sQ")  # nr, second word, ret, pid_tgid, args, comm, the kernel's clock
KTIME = 88  # where the clock is in the head
# A task event: what (FORK, EXIT), its number in the cell's pid namespace (0: not read), its host tid and
# tgid, the kernel's clock.
_TASK = struct.Struct("<IIIIQ")
FORK, EXIT = 1, 2
TASK_RING_SIZE = 2 << 20  # 87,000 events in flight
TASK_DROPS = 1 << 63  # the drop counter of a cell's task ring: its cgroup id with this bit
SCAN = 128  # a path below /usr, /lib or /sys this long or shorter is looked through for ".." in the kernel
RING_SIZE = 4 << 20  # tens of thousands of events in flight (an event takes its head and its path)
ARG_OFFSETS = (112, 104, 96, 56, 72, 64)  # x86_64 pt_regs: di, si, dx, r10, r8, r9
ORIG_AX = 120

PATH, SOCKADDR, MSGHDR, WORD = 1, 2, 3, 4
# EPERM … EROFS; EADDRNOTAVAIL … EHOSTUNREACH; EINPROGRESS (a non-blocking connect: refused only later)
_ERRNOS = (1, 2, 3, 13, 16, 18, 30, 99, 101, 111, 113, 115)
ENOENT = 2

# x86_64: call -> (number, what its arguments are): [(kind, argument index)] for the first buffer, then
# a second path. Not stat, access or readlink: asking whether something exists reaches nothing.
CALLS: dict[str, tuple[int, tuple[tuple[int, int], ...]]] = {
    "open": (2, ((PATH, 0),)), "creat": (85, ((PATH, 0),)), "openat": (257, ((PATH, 1),)),
    "openat2": (437, ((PATH, 1), (WORD, 2))), "execve": (59, ((PATH, 0),)), "execveat": (322, ((PATH, 1),)),
    "connect": (42, ((SOCKADDR, 1),)), "sendto": (44, ((SOCKADDR, 4),)), "sendmsg": (46, ((MSGHDR, 1),)),
    "sendmmsg": (307, ((MSGHDR, 1),)), "bind": (49, ((SOCKADDR, 1),)),  # (mmsghdr starts with a msghdr)
    "mkdir": (83, ((PATH, 0),)), "mkdirat": (258, ((PATH, 1),)), "rmdir": (84, ((PATH, 0),)),
    "unlink": (87, ((PATH, 0),)), "unlinkat": (263, ((PATH, 1),)), "rename": (82, ((PATH, 0), (PATH, 1))),
    "renameat": (264, ((PATH, 1), (PATH, 3))), "renameat2": (316, ((PATH, 1), (PATH, 3))),
    "link": (86, ((PATH, 0), (PATH, 1))), "linkat": (265, ((PATH, 1), (PATH, 3))),
    "symlink": (88, ((PATH, 1), (PATH, 0))), "symlinkat": (266, ((PATH, 2), (PATH, 0))),
    "chmod": (90, ((PATH, 0),)), "fchmodat": (268, ((PATH, 1),)), "fchmodat2": (452, ((PATH, 1),)),
    "chown": (92, ((PATH, 0),)), "lchown": (94, ((PATH, 0),)), "fchownat": (260, ((PATH, 1),)),
    "truncate": (76, ((PATH, 0),)), "mknod": (133, ((PATH, 0),)), "mknodat": (259, ((PATH, 1),)),
    "chdir": (80, ((PATH, 0),)), "setxattr": (188, ((PATH, 0),)), "lsetxattr": (189, ((PATH, 0),)),
    "removexattr": (197, ((PATH, 0),)), "lremovexattr": (198, ((PATH, 0),)), "utimensat": (280, ((PATH, 1),)),
    "utime": (132, ((PATH, 0),)), "utimes": (235, ((PATH, 0),)), "futimesat": (261, ((PATH, 1),)),
    "pidfd_open": (434, ()), "kill": (62, ()), "socket": (41, ()),
}
NAMES = {nr: name for name, (nr, _) in CALLS.items()}
# where the directory fd of an *at call is (its path is relative to it)
DIRFD = {"openat": 0, "openat2": 0, "execveat": 0, "mkdirat": 0, "unlinkat": 0, "renameat": 0, "renameat2": 0,
         "linkat": 0, "symlinkat": 1, "fchmodat": 0, "fchmodat2": 0, "fchownat": 0, "mknodat": 0, "utimensat": 0,
         "futimesat": 0}
DIRFD2 = {"renameat": 2, "renameat2": 2, "linkat": 2}
AT_FDCWD = -100
# openat's flags (argument 2) and open's (1): what the open was for
O_ACCMODE, O_CREAT, O_TRUNC = 3, 0o100, 0o1000


def supported() -> str:
    """Empty if this source can run here, else why not."""
    if os.uname().machine != "x86_64":
        return f"its call table knows x86_64 only (this is {os.uname().machine})"
    if os.geteuid() != 0:
        return "eBPF needs root (CAP_BPF, CAP_PERFMON)"
    return ""


def _spec(args: tuple[tuple[int, int], ...]) -> int:
    out = 1 << 16  # watched
    for shift, (kind, index) in zip((0, 8), args, strict=False):
        out |= (kind | index << 4) << shift
    return out


def _argument(a: bpf.Asm, spec: int, shift: int, into: int) -> None:
    """``into`` = the event's saved argument whose index the spec (in ``spec``) holds at ``shift``."""
    a.alu("mov", bpf.R2, spec)
    a.alu("rsh", bpf.R2, imm=shift)
    a.alu("and", bpf.R2, imm=7)
    a.alu("lsh", bpf.R2, imm=3)
    a.alu("mov", bpf.R3, bpf.R8)
    a.alu("add", bpf.R3, bpf.R2)
    a.ldx(bpf.DW, into, bpf.R3, 24)


KEY = -24  # where on the stack the programs keep the caller's cgroup id: the key of ``cells`` and ``drops``


def _cell_ring(a: bpf.Asm, cells_fd: int) -> None:
    """R0 = the ring of the cell whose cgroup id is at KEY, or to ``out`` if no cell has that cgroup."""
    a.ld64(bpf.R1, cells_fd, map_fd=True)
    a.alu("mov", bpf.R2, bpf.R10)
    a.alu("add", bpf.R2, imm=KEY)
    a.call(bpf.MAP_LOOKUP)
    a.j("jeq", bpf.R0, "out", imm=0)


def _count_drop(a: bpf.Asm, drops_fd: int, *, tasks: bool = False) -> None:
    """The cell's ring was full: one more in its drop counter (keyed by its cgroup id, at KEY, with
    TASK_DROPS for its task ring), so its monitor knows it missed some."""
    if tasks:
        a.ldx(bpf.DW, bpf.R1, bpf.R10, KEY)
        a.ld64(bpf.R2, TASK_DROPS)
        a.alu("or", bpf.R1, bpf.R2)
        a.stx(bpf.DW, bpf.R10, KEY, bpf.R1)
    a.ld64(bpf.R1, drops_fd, map_fd=True)
    a.alu("mov", bpf.R2, bpf.R10)
    a.alu("add", bpf.R2, imm=KEY)
    a.call(bpf.MAP_LOOKUP)
    a.j("jeq", bpf.R0, "out", imm=0)
    a.alu("mov", bpf.R1, imm=1)
    a.atomic_add(bpf.R0, 0, bpf.R1)


def _pointer(a: bpf.Asm, base_reg: int, offset: int, fail: str, slot: int) -> None:
    """R3 = *(u64 *)(base_reg + offset), read from the kernel through the stack at ``slot``; to ``fail``
    if it cannot be read or is NULL."""
    a.alu("mov", bpf.R3, base_reg)
    a.alu("add", bpf.R3, imm=offset)
    a.alu("mov", bpf.R1, bpf.R10)
    a.alu("add", bpf.R1, imm=slot)
    a.alu("mov", bpf.R2, imm=8)
    a.call(bpf.PROBE_READ_KERNEL)
    a.j("jne", bpf.R0, fail, imm=0)
    a.ldx(bpf.DW, bpf.R3, bpf.R10, slot)
    a.j("jeq", bpf.R3, fail, imm=0)


def program(table_fd: int, cells_fd: int, drops_fd: int, scratch_fd: int) -> bytes:
    """The program, for every watched cell on the host: ``cells`` maps a cell's cgroup id (its cgroup2
    directory's inode number) to its own ring (:mod:`.hostprog`)."""
    R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10 = (bpf.R0, bpf.R1, bpf.R2, bpf.R3, bpf.R4, bpf.R5, bpf.R6, bpf.R7,
                                                   bpf.R8, bpf.R9, bpf.R10)
    lo = sum(1 << e for e in _ERRNOS if e < 64)
    hi = sum(1 << (e - 64) for e in _ERRNOS if e >= 64)
    a = bpf.Asm()
    # raw tracepoint sys_exit: ctx->args[0] is the caller's registers (struct pt_regs *), args[1] the result
    a.alu("mov", R6, R1)
    a.ldx(bpf.DW, R7, R6, 8)
    a.j("jsge", R7, "out", imm=0)  # it succeeded
    a.j("jslt", R7, "out", imm=-127)
    a.alu("mov", R1, R7)
    a.alu("neg", R1)  # errno
    a.ld64(R2, lo)
    a.j("jlt", R1, "bit", imm=64)
    a.ld64(R2, hi)
    a.alu("sub", R1, imm=64)
    a.label("bit")
    a.alu("rsh", R2, R1)
    a.alu("and", R2, imm=1)
    a.j("jeq", R2, "out", imm=0)  # not an errno of interest
    a.call(bpf.GET_CURRENT_CGROUP_ID)
    a.stx(bpf.DW, R10, KEY, R0)
    _cell_ring(a, cells_fd)  # not a watched cell's
    a.alu("mov", R1, R10)  # the call's number, onto the stack
    a.alu("add", R1, imm=-8)
    a.alu("mov", R2, imm=8)
    a.ldx(bpf.DW, R3, R6, 0)
    a.alu("add", R3, imm=ORIG_AX)
    a.call(bpf.PROBE_READ_KERNEL)
    a.j("jne", R0, "out", imm=0)
    a.ldx(bpf.DW, R1, R10, -8)
    a.j("jgt", R1, "out", imm=511)
    a.stx(bpf.W, R10, -12, R1)
    a.ld64(R1, table_fd, map_fd=True)  # what its arguments are, if it is one of ours
    a.alu("mov", R2, R10)
    a.alu("add", R2, imm=-12)
    a.call(bpf.MAP_LOOKUP)
    a.j("jeq", R0, "out", imm=0)
    a.ldx(bpf.DW, R9, R0, 0)
    a.j("jeq", R9, "out", imm=0)
    # The event is built in a per-CPU buffer (a program runs to its end on its CPU: no preemption here),
    # filtered there, and only then copied into the ring, as long as it is: a dropped lookup costs the
    # ring nothing, and a burst of them cannot fill it.
    a.st(bpf.W, R10, -16, 0)
    a.ld64(R1, scratch_fd, map_fd=True)
    a.alu("mov", R2, R10)
    a.alu("add", R2, imm=-16)
    a.call(bpf.MAP_LOOKUP)
    a.j("jeq", R0, "out", imm=0)
    a.alu("mov", R8, R0)
    a.ldx(bpf.DW, R1, R10, -8)
    a.stx(bpf.DW, R8, 0, R1)
    a.stx(bpf.DW, R8, 8, R7)
    _process(a)
    a.alu("mov", R1, R8)  # the registers, into the first buffer for a moment: the six arguments from there
    a.alu("add", R1, imm=A)
    a.alu("mov", R2, imm=168)
    a.ldx(bpf.DW, R3, R6, 0)
    a.call(bpf.PROBE_READ_KERNEL)
    for i, off in enumerate(ARG_OFFSETS):
        a.ldx(bpf.DW, R1, R8, A + off)
        a.stx(bpf.DW, R8, 24 + 8 * i, R1)
    a.st(bpf.DW, R8, A, 0)
    a.st(bpf.DW, R8, B, 0)
    a.alu("mov", R6, imm=1)  # the first buffer's length, as far as it is used (a path's is set below)
    # the first buffer: a path, an address, or a message's address
    a.alu("mov", R1, R9)
    a.alu("and", R1, imm=15)
    a.j("jeq", R1, "second", imm=0)
    _argument(a, R9, 4, R6)  # the user pointer (the registers are not needed any more)
    a.j("jeq", R1, "path", imm=PATH)
    a.j("jeq", R1, "msghdr", imm=MSGHDR)
    a.label("sockaddr")
    for size in (110, 28, 16):  # as much of the address as can be read
        a.alu("mov", R1, R8)
        a.alu("add", R1, imm=A)
        a.alu("mov", R2, imm=size)
        a.alu("mov", R3, R6)
        a.call(bpf.PROBE_READ_USER)
        a.j("jeq", R0, "addressed", imm=0)
    a.label("addressed")
    a.alu("mov", R6, imm=110)
    a.j("ja", R0, "second")
    a.label("msghdr")  # msg_name and msg_namelen, into the second buffer; then the address they point at
    a.alu("mov", R1, R8)
    a.alu("add", R1, imm=B)
    a.alu("mov", R2, imm=16)
    a.alu("mov", R3, R6)
    a.call(bpf.PROBE_READ_USER)
    a.j("jne", R0, "addressed", imm=0)
    a.ldx(bpf.DW, R6, R8, B)
    a.j("jeq", R6, "addressed", imm=0)
    a.j("ja", R0, "sockaddr")
    a.label("path")
    a.alu("mov", R1, R8)
    a.alu("add", R1, imm=A)
    a.alu("mov", R2, imm=PATH_MAX)
    a.alu("mov", R3, R6)
    a.call(bpf.PROBE_READ_USER_STR)
    a.alu("mov", R6, R0)  # its length (with the NUL), for the filter below
    a.label("second")  # a second path (rename, link, symlink), or a word (openat2's how)
    a.alu("mov", R1, R9)
    a.alu("rsh", R1, imm=8)
    a.alu("and", R1, imm=15)
    a.j("jeq", R1, "word", imm=WORD)
    a.j("jne", R1, "filter", imm=PATH)
    _argument(a, R9, 12, R3)
    a.alu("mov", R1, R8)
    a.alu("add", R1, imm=B)
    a.alu("mov", R2, imm=PATH_MAX)
    a.call(bpf.PROBE_READ_USER_STR)
    a.j("ja", R0, "filter")
    a.label("word")
    _argument(a, R9, 12, R3)
    a.alu("mov", R1, R8)
    a.alu("add", R1, imm=B)
    a.alu("mov", R2, imm=8)
    a.call(bpf.PROBE_READ_USER)
    # Missing files under /usr/, /lib/, /lib64/ and /sys/ are everyday lookups (locales, libraries,
    # hardware), and nothing is hidden there: the cell sees those trees as they are (or, /sys, not at
    # all). Dropped here, unless the path has a ".." or is longer than SCAN: then where it leads is for
    # the monitor to say. Under /sys only a look is (an open to read, an exec, a chdir): a write there
    # (a kernel setting, a control group made) goes up.
    a.label("filter")
    a.j("jne", R7, "submit", imm=-ENOENT)
    a.alu("mov", R1, R9)
    a.alu("and", R1, imm=15)
    a.j("jne", R1, "submit", imm=PATH)
    a.ldx(bpf.W, R1, R8, A)
    a.ldx(bpf.B, R2, R8, A + 4)
    a.j("jne", R1, "usr", imm=int.from_bytes(b"/lib", "little"))
    a.j("jeq", R2, "dots", imm=ord("/"))
    a.j("jeq", R2, "dots", imm=ord("6"))
    a.j("ja", R0, "submit")
    a.label("usr")
    a.j("jne", R2, "submit", imm=ord("/"))
    a.j("jeq", R1, "dots", imm=int.from_bytes(b"/usr", "little"))
    a.j("jne", R1, "submit", imm=int.from_bytes(b"/sys", "little"))
    a.ldx(bpf.DW, R1, R8, 0)  # /sys: what the call is
    for name in ("execve", "execveat", "chdir"):
        a.j("jeq", R1, "dots", imm=CALLS[name][0])
    for name, at in (("open", 24 + 8), ("openat", 24 + 16), ("openat2", B)):  # its flags (openat2's: read into B)
        a.ldx(bpf.DW, R2, R8, at)
        a.j("jeq", R1, "flags", imm=CALLS[name][0])
    a.j("ja", R0, "submit")  # any other call here writes
    a.label("flags")
    a.alu("and", R2, imm=O_ACCMODE | O_CREAT | O_TRUNC)
    a.j("jne", R2, "submit", imm=0)
    a.label("dots")  # look for ".." up to the end of the path (a long one goes up whole: rare, and looked at)
    a.j("jsgt", R6, "submit", imm=SCAN)
    a.alu("mov", R3, imm=0)
    a.label("scan")
    a.j("jgt", R3, "submit", imm=SCAN - 2)
    a.alu("mov", R4, R8)
    a.alu("add", R4, R3)
    a.ldx(bpf.B, R5, R4, A)
    a.j("jeq", R5, "discard", imm=0)
    a.j("jne", R5, "next", imm=ord("."))
    a.ldx(bpf.B, R5, R4, A + 1)
    a.j("jeq", R5, "submit", imm=ord("."))
    a.label("next")
    a.alu("add", R3, imm=1)
    a.j("ja", R0, "scan")
    a.label("submit")  # as long as it is: the whole event with a second buffer, else up to the first's end
    a.alu("mov", R1, R9)
    a.alu("rsh", R1, imm=8)
    a.alu("and", R1, imm=15)
    a.alu("mov", R3, imm=EVENT_SIZE)
    a.j("jne", R1, "output", imm=0)
    a.alu("mov", R3, R6)
    a.j("jsgt", R3, "positive", imm=0)
    a.alu("mov", R3, imm=1)
    a.label("positive")
    a.j("jle", R3, "bounded", imm=PATH_MAX)
    a.alu("mov", R3, imm=PATH_MAX)
    a.label("bounded")
    a.alu("add", R3, imm=A)
    a.label("output")
    a.alu("mov", R7, R3)  # (the call's result is not needed any more)
    _cell_ring(a, cells_fd)  # (again: a map's value is not kept across calls; the cell may have gone since)
    a.alu("mov", R1, R0)
    a.alu("mov", R2, R8)
    a.alu("mov", R3, R7)
    a.alu("mov", R4, imm=0)
    a.call(bpf.RINGBUF_OUTPUT)
    a.j("jne", R0, "dropped", imm=0)
    a.j("ja", R0, "out")
    a.label("discard")
    a.j("ja", R0, "out")
    a.label("dropped")
    _count_drop(a, drops_fd)
    a.j("ja", R0, "out")
    a.label("out")
    a.alu("mov", R0, imm=0)
    a.exit()
    return a.code()


EXEC_NAME = 256  # an exec's file name, at most (longer: cut, and not used as a name)
SETID = 0o6000  # S_ISUID | S_ISGID
MODE_KNOWN = 1 << 16  # in an exec event's second word: the file's mode was read


def exec_program(cells_fd: int, drops_fd: int, layout: dict[str, int] | None) -> bytes:
    """For the ``sched_process_exec`` raw tracepoint (task, old pid, binprm): each exec of the cell's that
    succeeded, as an event of errno 0, with the new program's name (the task's comm is already the new one) and,
    where the kernel's BTF says where things lie (``layout``: EXEC_FIELDS of :func:`kernel_layout`), the file as
    execve was given it (``linux_binprm.filename``, the kernel's own copy, at most EXEC_NAME bytes) and the mode
    of the file that runs (``binprm->file->f_inode->i_mode``: setuid and setgid are seen there, exactly, though
    the process is gone by the time the event is read). A process that exits at once is still named; the calls
    that succeed pay nothing for it. Each event takes its head and EXEC_NAME bytes of the ring: a burst of tens
    of thousands of execs fits. Its first argument is the host tid that called exec: a thread other than the
    leader gave its own number up (the kernel's de_thread), with no exit of its own."""
    R0, R1, R2, R3, R6, R8, R10 = bpf.R0, bpf.R1, bpf.R2, bpf.R3, bpf.R6, bpf.R8, bpf.R10
    a = bpf.Asm()
    a.alu("mov", R6, R1)  # the tracepoint's arguments
    # its head, and the file's name (its second word: the mode, below)
    _reserve(a, cells_fd, A if layout is None else A + EXEC_NAME, CALLS["execve"][0])
    a.ldx(bpf.DW, R1, R6, 8)  # its first argument: the tid that exec'd (another than the leader's: it was freed)
    a.stx(bpf.DW, R8, 24, R1)
    if layout is not None:
        a.st(bpf.B, R8, A, 0)  # (empty if it cannot be read)

        def pointer(base_reg: int, offset: int, fail: str) -> None:
            _pointer(a, base_reg, offset, fail, -8)

        a.ldx(bpf.DW, R3, R6, 16)  # the binprm
        a.j("jeq", R3, "submit", imm=0)
        a.stx(bpf.DW, R10, -16, R3)
        pointer(R3, layout["filename"], "mode")
        a.alu("mov", R1, R8)
        a.alu("add", R1, imm=A)
        a.alu("mov", R2, imm=EXEC_NAME)
        a.call(bpf.PROBE_READ_KERNEL_STR)
        a.label("mode")
        a.ldx(bpf.DW, R3, R10, -16)
        pointer(R3, layout["file"], "submit")
        pointer(R3, layout["f_inode"], "submit")
        a.alu("add", R3, imm=layout["i_mode"])
        a.st(bpf.DW, R10, -8, 0)
        a.alu("mov", R1, R10)
        a.alu("add", R1, imm=-8)
        a.alu("mov", R2, imm=2)
        a.call(bpf.PROBE_READ_KERNEL)
        a.j("jne", R0, "submit", imm=0)
        a.ldx(bpf.DW, R1, R10, -8)
        a.alu("or", R1, imm=MODE_KNOWN)
        a.stx(bpf.W, R8, 4, R1)
    _submit(a, drops_fd)
    return a.code()


def _reserve(a: bpf.Asm, cells_fd: int, size: int, nr: int) -> None:
    """R8 = ``size`` bytes reserved in the ring of the cell the current task is in (to ``out`` if it is in
    none, to ``dropped`` if the ring is full), its head written: ``nr`` (its second word 0), result 0,
    no arguments, the process and its name, the kernel's clock. Ends with :func:`_submit`."""
    R0, R1, R2, R3, R8, R10 = bpf.R0, bpf.R1, bpf.R2, bpf.R3, bpf.R8, bpf.R10
    a.call(bpf.GET_CURRENT_CGROUP_ID)
    a.stx(bpf.DW, R10, KEY, R0)
    _cell_ring(a, cells_fd)
    a.alu("mov", R1, R0)
    a.alu("mov", R2, imm=size)
    a.alu("mov", R3, imm=0)
    a.call(bpf.RINGBUF_RESERVE)
    a.j("jeq", R0, "dropped", imm=0)
    a.alu("mov", R8, R0)
    a.st(bpf.DW, R8, 0, nr)
    for off in range(8, 72, 8):  # the result, the process (below), the arguments
        a.st(bpf.DW, R8, off, 0)
    _process(a)


def _process(a: bpf.Asm) -> None:
    """Into the head at R8: the current process and thread, its name, the kernel's clock."""
    a.call(bpf.GET_CURRENT_PID_TGID)
    a.stx(bpf.DW, bpf.R8, 16, bpf.R0)
    a.alu("mov", bpf.R1, bpf.R8)
    a.alu("add", bpf.R1, imm=72)
    a.alu("mov", bpf.R2, imm=16)
    a.call(bpf.GET_CURRENT_COMM)
    a.call(bpf.KTIME_GET_NS)
    a.stx(bpf.DW, bpf.R8, KTIME, bpf.R0)


def _submit(a: bpf.Asm, drops_fd: int, *, tasks: bool = False) -> None:
    """The record at R8 handed over (``submit``), or counted as dropped (``dropped``); the program's end."""
    a.label("submit")
    a.alu("mov", bpf.R1, bpf.R8)
    a.alu("mov", bpf.R2, imm=0)
    a.call(bpf.RINGBUF_SUBMIT)
    a.j("ja", bpf.R0, "out")
    a.label("dropped")
    _count_drop(a, drops_fd, tasks=tasks)
    a.label("out")
    a.alu("mov", bpf.R0, imm=0)
    a.exit()


def task_program(kind: int, tasks_fd: int, drops_fd: int, layout: dict[str, int] | None) -> bytes:
    """For ``sched_process_fork`` (FORK: the new task is its second argument) or ``sched_process_exit``
    (EXIT: the current task): a :class:`TaskEvent` of each task of the cell, threads too, into the cell's
    task ring, with the number the task has in its innermost pid namespace, the cell's
    (``task->thread_pid->numbers[level].nr``, where ``layout``, TASK_FIELDS of :func:`kernel_layout`, says
    where those lie; 0 where it cannot be read). The exit tracepoint fires before the task leaves its
    namespace: the event is in the ring before any call can find that number gone."""
    R0, R1, R2, R3, R6, R8, R9, R10 = bpf.R0, bpf.R1, bpf.R2, bpf.R3, bpf.R6, bpf.R8, bpf.R9, bpf.R10
    a = bpf.Asm()
    a.alu("mov", R6, R1)  # the tracepoint's arguments
    a.call(bpf.GET_CURRENT_CGROUP_ID)  # (the forking task's, at a fork: the new one is born in it)
    a.stx(bpf.DW, R10, KEY, R0)
    _cell_ring(a, tasks_fd)
    a.alu("mov", R1, R0)
    a.alu("mov", R2, imm=_TASK.size)
    a.alu("mov", R3, imm=0)
    a.call(bpf.RINGBUF_RESERVE)
    a.j("jeq", R0, "dropped", imm=0)
    a.alu("mov", R8, R0)
    a.st(bpf.DW, R8, 0, kind)  # (the number 0 until it is read)
    a.st(bpf.DW, R8, 8, 0)
    a.call(bpf.KTIME_GET_NS)
    a.stx(bpf.DW, R8, 16, R0)
    if kind == FORK:
        a.ldx(bpf.DW, R9, R6, 8)  # the new task
    else:
        a.call(bpf.GET_CURRENT_TASK)
        a.alu("mov", R9, R0)
    if layout is not None:
        for field, at in (("pid", 8), ("tgid", 12)):
            a.alu("mov", R1, R8)
            a.alu("add", R1, imm=at)
            a.alu("mov", R2, imm=4)
            a.alu("mov", R3, R9)
            a.alu("add", R3, imm=layout[field])
            a.call(bpf.PROBE_READ_KERNEL)
        _pointer(a, R9, layout["thread_pid"], "submit", -8)  # R3: the task's struct pid
        a.stx(bpf.DW, R10, -16, R3)
        a.alu("add", R3, imm=layout["level"])
        a.st(bpf.DW, R10, -8, 0)
        a.alu("mov", R1, R10)
        a.alu("add", R1, imm=-8)
        a.alu("mov", R2, imm=4)
        a.call(bpf.PROBE_READ_KERNEL)
        a.j("jne", R0, "submit", imm=0)
        a.ldx(bpf.DW, R1, R10, -8)
        a.j("jgt", R1, "submit", imm=MAX_PID_NS_LEVEL)
        a.alu("mul", R1, imm=layout["upid_ns"] + 8)  # (struct upid: the number, then a pointer)
        a.ldx(bpf.DW, R3, R10, -16)
        a.alu("add", R3, R1)
        a.alu("add", R3, imm=layout["numbers"] + layout["upid_nr"])
        a.alu("mov", R1, R8)
        a.alu("add", R1, imm=4)
        a.alu("mov", R2, imm=4)
        a.call(bpf.PROBE_READ_KERNEL)
    _submit(a, drops_fd, tasks=True)
    return a.code()


MAX_PID_NS_LEVEL = 32  # the kernel's own bound on nested pid namespaces
# Where things lie in the kernel's structures (its BTF), by what each program reads: an exec's file and
# its mode; an ending task's number in its innermost pid namespace.
EXEC_FIELDS = {"filename": ("linux_binprm", "filename"), "file": ("linux_binprm", "file"),
               "f_inode": ("file", "f_inode"), "i_mode": ("inode", "i_mode")}
TASK_FIELDS = {"pid": ("task_struct", "pid"), "tgid": ("task_struct", "tgid"),
               "thread_pid": ("task_struct", "thread_pid"), "level": ("pid", "level"), "numbers": ("pid", "numbers"),
               "upid_nr": ("upid", "nr"), "upid_ns": ("upid", "ns")}


def part(layout: dict[str, int], fields: dict[str, tuple[str, str]]) -> dict[str, int] | None:
    """The offsets ``fields`` names, if the layout has them all."""
    return layout if all(k in layout for k in fields) else None


@functools.lru_cache(maxsize=1)
def kernel_layout() -> dict[str, int]:
    """The offsets of EXEC_FIELDS and TASK_FIELDS on this kernel, as far as its BTF has them (none
    without BTF). Read from the BTF once a boot and kept in root's runtime directory: twenty sessions
    starting at once each reading 5 MB slowed the monitors already listening to the host's forks (their
    connector overflowed)."""
    import json

    from .. import hostfs
    from ..errors import AgentcellError
    from .btf import VMLINUX, offsets

    where = {**EXEC_FIELDS, **TASK_FIELDS}
    try:
        st = os.stat(VMLINUX)
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = (f"{f.read().strip()} {os.uname().release} {os.uname().version} {st.st_size} {st.st_mtime_ns} "
                   f"{sorted(where.items())}")
    except OSError:
        return {}
    cache = os.path.join(hostfs.RUN, "btf-layout.json")
    try:
        with open(cache) as f:
            kept = json.load(f)
        if kept.get("key") == key:
            return {k: int(v) for k, v in kept["layout"].items() if k in where}
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        pass
    found = offsets(where.values())
    out = {k: v for k, w in where.items() if (v := found[w]) is not None}
    try:
        hostfs.run_dir()
        tmp = f"{cache}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"key": key, "layout": out}, f)
        os.replace(tmp, cache)
    except (OSError, AgentcellError):  # (root's runtime directory unusable: read again next time)
        pass
    return out


def check() -> str:
    """Empty if the program loads here (maps made, the verifier passes: nothing is attached), else why not."""
    why = supported()
    if why:
        return why
    fds: list[int] = []
    try:
        fds.extend(_maps(1 << 16, 1))
        fds.extend(bpf.prog_load(bpf.PROG_RAW_TRACEPOINT, code, name) for _, _, code, name in _programs(*fds))
    except OSError as e:
        return str(e.strerror or e)
    finally:
        for fd in fds:
            os.close(fd)
    return ""


def _programs(table: int, cells: int, tasks: int, drops: int, scratch: int) -> list[tuple[str, str, bytes, str]]:
    """(the link's name, the raw tracepoint, the program, its name) of each program, over these maps."""
    layout = kernel_layout()
    return [("calls_link", "sys_exit", program(table, cells, drops, scratch), "agentcell_calls"),
            ("exec_link", "sched_process_exec", exec_program(cells, drops, part(layout, EXEC_FIELDS)),
             "agentcell_execs"),
            ("fork_link", "sched_process_fork", task_program(FORK, tasks, drops, part(layout, TASK_FIELDS)),
             "agentcell_forks"),
            ("exit_link", "sched_process_exit", task_program(EXIT, tasks, drops, part(layout, TASK_FIELDS)),
             "agentcell_exits")]


def _maps(ring_size: int, cells: int) -> list[int]:
    """The programs' maps: the call table (filled), ``cells`` (cgroup id -> a ring of ``ring_size``),
    ``tasks`` (cgroup id -> a task ring of TASK_RING_SIZE), ``drops`` (cgroup id, and with TASK_DROPS for
    the task ring -> count), the per-CPU buffer an event is built in."""
    fds: list[int] = []
    try:
        fds.append(bpf.map_create(bpf.MAP_ARRAY, 4, 8, 512, "agentcell_calls"))
        for nr, kinds in CALLS.values():
            bpf.map_update(fds[0], struct.pack("<I", nr), struct.pack("<Q", _spec(kinds)))
        for size, name in ((ring_size, "agentcell_cells"), (min(ring_size, TASK_RING_SIZE), "agentcell_tasks")):
            like = bpf.map_create(bpf.MAP_RINGBUF, 0, 0, size, "agentcell_ring")
            try:
                fds.append(bpf.map_create(bpf.MAP_HASH_OF_MAPS, 8, 4, cells, name, inner=like))
            finally:
                os.close(like)
        fds.append(bpf.map_create(bpf.MAP_HASH, 8, 8, 2 * cells, "agentcell_drops"))
        fds.append(bpf.map_create(bpf.MAP_PERCPU_ARRAY, 4, EVENT_SIZE, 1, "agentcell_event"))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _attached() -> dict[str, int]:
    """The host's programs, loaded and attached (:mod:`.hostprog` shares them): the fds it hands over."""
    fds = _maps(RING_SIZE, hostprog.CELLS)
    out: dict[str, int] = {}
    try:
        _table, cells, tasks, drops, _scratch = fds
        for link, tracepoint, code, name in _programs(*fds):
            prog = bpf.prog_load(bpf.PROG_RAW_TRACEPOINT, code, name)
            try:
                out[link] = bpf.attach_raw_tracepoint(tracepoint, prog)
            finally:
                os.close(prog)
        out["cells"], out["tasks"], out["drops"] = os.dup(cells), os.dup(tasks), os.dup(drops)
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    finally:
        for fd in fds:  # (the programs hold the table and the buffer)
            os.close(fd)
    return out


@functools.lru_cache(maxsize=1)
def _version() -> str:
    """This build of the programs (fds as placeholders)."""
    return hostprog.version(*(code for _, _, code, _ in _programs(1, 2, 3, 4, 5)), RING_SIZE, EVENT_SIZE,
                            TASK_RING_SIZE, hostprog.CELLS, repr(sorted(CALLS.items())).encode())


class Call:
    """One failed call: ``name``, ``errno``, ``pid`` (the process, host pid), ``tid``, ``comm``, ``args``
    (raw), ``path`` and ``path2`` (as given, maybe relative), ``addr`` (("inet"|"inet6", ip, port),
    ("unix", path), ("abstract", name) or None), ``flags`` (an open's; for an exec that succeeded, its
    file's mode, with MODE_KNOWN set if it was read, and ``args[0]`` the host tid that called exec),
    ``ktime`` (the kernel's CLOCK_MONOTONIC, ns)."""

    __slots__ = ("name", "errno", "pid", "tid", "comm", "args", "path", "path2", "addr", "flags", "ktime")

    def __init__(self, name: str, errno: int, pid: int, tid: int, comm: str, args: tuple[int, ...], path: str = "",
                 path2: str = "", addr: tuple[Any, ...] | None = None, flags: int = 0, ktime: int = 0) -> None:
        self.name, self.errno, self.pid, self.tid, self.comm, self.args = name, errno, pid, tid, comm, args
        self.path, self.path2, self.addr, self.ktime = path, path2, addr, ktime
        self.flags = flags or {"open": args[1], "openat": args[2], "creat": O_CREAT | O_TRUNC | 1}.get(name, 0)

    def __repr__(self) -> str:
        return f"Call({self.name} -> {self.errno} pid {self.pid} {self.comm!r} {self.path!r} {self.path2!r} " \
               f"{self.addr!r})"


def _text(raw: bytes, at: int) -> str:
    end = raw.find(b"\0", at, at + PATH_MAX)
    return os.fsdecode(raw[at:end if end >= 0 else at + PATH_MAX])


def decode(raw: bytes) -> Call | None:
    if len(raw) < A:
        return None
    raw = raw.ljust(EVENT_SIZE, b"\0")  # (the ring holds an event as long as its paths are)
    nr, second, ret, pid_tgid, *rest = _HEAD.unpack_from(raw, 0)
    args, comm, ktime = tuple(rest[:6]), rest[6].split(b"\0")[0].decode(errors="replace"), rest[7]
    name = NAMES.get(nr)
    if name is None:
        return None
    kinds = CALLS[name][1]
    call = Call(name, -ret, pid_tgid >> 32, pid_tgid & 0xFFFFFFFF, comm, args, ktime=ktime)
    first = kinds[0][0] if kinds else 0
    if first == PATH:
        call.path = _text(raw, A)
    elif first == SOCKADDR:
        length = args[5] if name == "sendto" else args[2]
        call.addr = sockaddr(raw[A:A + 110], length)
    elif first == MSGHDR:
        length = struct.unpack_from("<I", raw, B + 8)[0] if struct.unpack_from("<Q", raw, B)[0] else 0
        call.addr = sockaddr(raw[A:A + 110], length) if length else None
    if ret == 0 and name == "execve":  # an exec that succeeded (the exec program): its file's mode
        call.flags = second
        if len(os.fsencode(call.path)) >= EXEC_NAME - 1:  # cut: not a name
            call.path = ""
        return call
    if len(kinds) > 1 and kinds[1][0] == PATH:
        call.path2 = _text(raw, B)
    elif len(kinds) > 1 and kinds[1][0] == WORD:
        call.flags = struct.unpack_from("<Q", raw, B)[0]
    return call


def sockaddr(data: bytes, length: int) -> tuple[Any, ...] | None:
    """An address as the call gave it (``length`` bytes of it)."""
    if len(data) < 2:
        return None
    family = struct.unpack_from("<H", data, 0)[0]
    if family == socket.AF_INET and len(data) >= 8:
        return ("inet", socket.inet_ntop(socket.AF_INET, data[4:8]), struct.unpack_from(">H", data, 2)[0])
    if family == socket.AF_INET6 and len(data) >= 24:
        return ("inet6", socket.inet_ntop(socket.AF_INET6, data[8:24]), struct.unpack_from(">H", data, 2)[0])
    if family == socket.AF_UNIX:
        body = data[2:max(2, min(length, len(data)))]
        if body[:1] == b"\0":
            return ("abstract", body[1:].decode(errors="replace"))
        return ("unix", os.fsdecode(body.split(b"\0")[0])) if body else None
    return None


class TaskEvent(NamedTuple):
    """A task of the cell started (FORK) or ended (EXIT): its number in the cell's pid namespace (0: not
    known), its host tid and tgid, when (the kernel's CLOCK_MONOTONIC, ns)."""

    kind: int
    number: int
    tid: int
    tgid: int
    ktime: int


def decode_task(raw: bytes) -> TaskEvent | None:
    return TaskEvent(*_TASK.unpack_from(raw, 0)) if len(raw) >= _TASK.size else None


class FailedCalls:
    """One cell's failed calls and its tasks: two rings of its own (calls, :class:`TaskEvent`), which the
    host's programs (:mod:`.hostprog`: one copy for every cell) fill from the moment its cgroup is added
    to them; :meth:`read` and :meth:`read_tasks` what they saw. Close it when the cell has ended."""

    name = "calls"

    def __init__(self, cgroup_id: int) -> None:
        why = supported()
        if why:
            raise OSError(95, why)
        self.ring: bpf.RingBuffer | None = None
        self.tasks: bpf.RingBuffer | None = None
        self._key = struct.pack("<Q", cgroup_id)
        self._task_key = struct.pack("<Q", cgroup_id | TASK_DROPS)
        self._added: list[tuple[int, bytes]] = []  # the host's maps this cell is in, by key
        self.host: hostprog.HostPrograms | None = hostprog.acquire(_version(), _attached)
        try:
            self.ring = _ring(RING_SIZE)
            self.tasks = _ring(TASK_RING_SIZE)
            zero = struct.pack("<Q", 0)
            for fd, key, value in ((self.host.drops, self._key, zero), (self.host.drops, self._task_key, zero),
                                   (self.host.tasks, self._key, struct.pack("<I", self.tasks.fd)),
                                   (self.host.cells, self._key, struct.pack("<I", self.ring.fd))):
                try:
                    bpf.map_update(fd, key, value, bpf.NOEXIST)
                except OSError as e:
                    if e.errno == 17:
                        raise OSError(17, f"cgroup {cgroup_id} is watched by another monitor already") from None
                    raise
                self._added.append((fd, key))
        except BaseException:
            self.close()
            raise
        self._sweep()

    def _sweep(self) -> None:
        """Cells whose monitor was killed before it could take them out: their cgroups are gone (an id
        is never given again), and each keeps two rings alive while the programs run."""
        from ..cell.cgroups import v2_exists

        assert self.host is not None
        try:
            for key in bpf.map_keys(self.host.cells, 8):
                group = struct.unpack("<Q", key)[0]
                if key != self._key and v2_exists(group) is False:
                    for fd, k in ((self.host.cells, key), (self.host.tasks, key), (self.host.drops, key),
                                  (self.host.drops, struct.pack("<Q", group | TASK_DROPS))):
                        try:
                            bpf.map_delete(fd, k)
                        except OSError:
                            pass
        except OSError:  # (what is not swept now is swept by the next cell)
            pass

    def fileno(self) -> int:
        assert self.ring is not None
        return self.ring.fileno()

    def task_fileno(self) -> int:
        assert self.tasks is not None
        return self.tasks.fileno()

    def read(self, limit: int = 4096) -> list[Call]:
        """The failed calls recorded since the last read (at most ``limit``); never blocks."""
        assert self.ring is not None
        return [c for c in map(decode, self.ring.records(limit)) if c is not None]

    def read_tasks(self, limit: int = 1 << 16) -> list[TaskEvent]:
        """The cell's tasks started and ended since the last read (at most ``limit``); never blocks."""
        assert self.tasks is not None
        return [t for t in map(decode_task, self.tasks.records(limit)) if t is not None]

    def dropped(self) -> int:
        """Failed calls the kernel could not hand over (the ring was full), since the start."""
        assert self.host is not None
        return int(struct.unpack("<Q", bpf.map_lookup(self.host.drops, self._key, 8))[0])

    def tasks_dropped(self) -> int:
        """Task events the kernel could not hand over (a flood of threads filled the task ring)."""
        assert self.host is not None
        return int(struct.unpack("<Q", bpf.map_lookup(self.host.drops, self._task_key, 8))[0])

    def close(self) -> None:
        for fd, key in reversed(self._added):  # the programs stop writing to the rings before they go
            try:
                bpf.map_delete(fd, key)
            except OSError:
                pass
        self._added = []
        for ring in (self.ring, self.tasks):
            if ring is not None:
                ring.close()
                os.close(ring.fd)
        self.ring = self.tasks = None
        if self.host is not None:
            hostprog.release(self.host)
            self.host = None


def _ring(size: int) -> bpf.RingBuffer:
    fd = bpf.map_create(bpf.MAP_RINGBUF, 0, 0, size, "agentcell_ring")
    try:
        return bpf.RingBuffer(fd, size)
    except BaseException:
        os.close(fd)
        raise
