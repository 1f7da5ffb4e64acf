"""The eBPF programs of the failed-call source (:mod:`.calls`), and the layout of what they hand over.

One on the ``sys_exit`` raw tracepoint keeps the failed calls of watched cells that reach for something
(the call table says which, and where their paths and addresses are), one on ``sched_process_exec``
each exec with its file (offsets from the kernel's BTF), two on ``sched_process_fork`` and
``sched_process_exit`` each task that starts or ends, with its number in the cell's pid namespace.
Every event goes into the ring of the cell whose cgroup made it, found by cgroup id.
"""
from __future__ import annotations

import struct

from . import bpf
from .pidns import FORK

PATH_MAX = 4096  # a longer path fails with ENAMETOOLONG: nothing is reached
A = 96  # the first buffer: a path or an address
B = A + PATH_MAX  # the second: a second path, or a word the call points at (openat2's flags)
EVENT_SIZE = B + PATH_MAX
HEAD = struct.Struct("<IIqQ6Q16sQ")  # nr, second word, ret, pid_tgid, args, comm, the kernel's clock
KTIME = 88  # where the clock is in the head
# A task event: what (:data:`.pidns.FORK`, EXIT), its number in the cell's pid namespace (0: not read), its host tid and
# tgid, the kernel's clock.
TASK = struct.Struct("<IIIIQ")
TASK_RING_SIZE = 2 << 20  # 87,000 events in flight
TASK_DROPS = 1 << 63  # the drop counter of a cell's task ring: its cgroup id with this bit
SCAN = 128  # a path below /usr, /lib or /sys this long or shorter is looked through for ".." in the kernel
ARG_OFFSETS = (112, 104, 96, 56, 72, 64)  # x86_64 pt_regs: di, si, dx, r10, r8, r9
ORIG_AX = 120
RB_NO_WAKEUP = 1  # bpf_ringbuf_submit's flag: the consumer is not woken

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


def spec(args: tuple[tuple[int, int], ...]) -> int:
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
    """The record at R8 handed over (``submit``), or counted as dropped (``dropped``); the program's end.
    A task ring's reader is never woken (BPF_RB_NO_WAKEUP): no one waits on it (it is read with the cell's
    calls, :class:`agentcell.monitor.callsource.AttemptSource`), and a wake-up is an interrupt raised on
    the CPU of the forking or exiting task (on a virtual machine, an exit to the hypervisor) for each."""
    a.label("submit")
    a.alu("mov", bpf.R1, bpf.R8)
    a.alu("mov", bpf.R2, imm=RB_NO_WAKEUP if tasks else 0)
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
    a.alu("mov", R2, imm=TASK.size)
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
