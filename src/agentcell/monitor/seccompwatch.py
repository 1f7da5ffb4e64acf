"""seccomp refusals, reported: the monitored cell's filter hands its escape calls to us
(``SECCOMP_RET_USER_NOTIF``; why notification, see :mod:`agentcell.cell.seccomp`). Each notification
names the process (a host pid: we read in the host's pid namespace) and the call with its arguments;
we answer every one with the errno the plain filter would give — we never *allow* a call, so no
argument is read from the process's memory and nothing here is open to a time-of-check race.
"""
from __future__ import annotations

import errno
import fcntl
import os
import select
import struct
from typing import Any

from .event import CellEvent
from .procs import CellProcs

# _IOWR('!', 0, struct seccomp_notif) and _IOWR('!', 1, struct seccomp_notif_resp)
NOTIF_RECV, NOTIF_SEND = 0xC0502100, 0xC0182101
_NOTIF = struct.Struct("=QIIiIQ6Q")  # id, pid, flags, nr, arch, instruction pointer, args
_RESP = struct.Struct("=QqiI")  # id, val, error, flags
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

WHAT = {  # call -> (operation, what it is an attempt at)
    "ptrace": ("execute", "to trace another process"),
    "process_vm_readv": ("read", "to read another process's memory"),
    "process_vm_writev": ("write", "to write another process's memory"),
    "unshare": ("execute", "to make new namespaces"), "setns": ("execute", "to enter another namespace"),
    "clone": ("execute", "to make new namespaces"),
    "bpf": ("execute", "to load a kernel program"), "open_by_handle_at": ("read", "to open a file by handle"),
    "ioctl": ("write", "to type into a terminal"), "socket": ("network", "to open a VM socket (AF_VSOCK)"),
    "socketpair": ("network", "to open a VM socket (AF_VSOCK)"),
}
for _call in ("mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
              "open_tree", "mount_setattr"):
    WHAT[_call] = ("write", "to change the mount tree")
for _call in ("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "swapon", "swapoff",
              "reboot", "acct"):
    WHAT[_call] = ("execute", "to change the kernel")
# Noted, never acted on: ordinary software tries these and copes with EPERM (cell/seccomp.NOTED_CALLS).
NOTED = {"keyctl": "a kernel keyring", "add_key": "a kernel keyring", "request_key": "a kernel keyring",
         "perf_event_open": "performance counters", "userfaultfd": "user-space page faults",
         "io_uring_setup": "io_uring"}


def call_name(nr: int) -> str:
    try:
        import pyseccomp

        name = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, nr)
        return name.decode() if isinstance(name, bytes) else str(name)
    except (ImportError, ValueError, RuntimeError, OSError):
        return f"syscall {nr}"


class SeccompWatch:
    """The listener of one cell's filter (owned: closed by :meth:`close`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._names: dict[int, str] = {}

    def fileno(self) -> int:
        return self.fd

    def read(self) -> list[dict[str, Any]]:
        """Receive one pending notification; [] if it went away (its process was killed). Each must be
        refused with :meth:`refuse` once recorded (the caller waits in the call until then)."""
        buf = bytearray(_NOTIF.size)
        try:
            fcntl.ioctl(self.fd, NOTIF_RECV, buf, True)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EINTR):
                return []
            raise
        nid, pid, _flags, nr, _arch, _ip, *args = _NOTIF.unpack(buf)
        name = self._names.get(nr) or self._names.setdefault(nr, call_name(nr))
        from .execwatch import identify

        return [{"id": nid, "pid": pid, "call": name, "args": args, **identify(pid)}]

    def refuse(self, notification: dict[str, Any]) -> None:
        self.answer(notification["id"], -errno.EPERM)

    def answer(self, nid: int, error: int) -> None:
        try:
            fcntl.ioctl(self.fd, NOTIF_SEND, bytearray(_RESP.pack(nid, 0, error, 0)), True)
        except OSError as e:
            if e.errno != errno.ENOENT:  # the process is gone: nothing to answer
                raise

    def close(self) -> None:
        os.close(self.fd)  # pending and later notified calls now fail with ENOSYS: still refused


def describe(call: str, args: list[int]) -> tuple[str, str, str]:
    """(operation, target, reason) of a refused call."""
    if call in NOTED:
        return "execute", call, (f"{NOTED[call]}, a kernel surface software tries and copes without (refused by "
                                 "seccomp: EPERM)")
    op, what = WHAT.get(call, ("execute", "a call cells may not make"))
    if call == "ioctl":
        target = "TIOCSTI" if args[1] & 0xFFFFFFFF == TIOCSTI else "TIOCLINUX"
        return op, f"ioctl {target}", f"an attempt {what} (fd {args[0]}); refused by seccomp"
    if call in ("ptrace", "process_vm_readv", "process_vm_writev"):
        pid = args[1] if call == "ptrace" else args[0]
        return op, f"{call} pid {pid & 0xFFFFFFFF}", f"an attempt {what}; refused by seccomp"
    return op, call, f"an attempt {what}; refused by seccomp"


class SeccompSource:
    """The ``seccomp`` source: each escape call the filter handed over, as an event; the caller waits in
    the call until :meth:`release` refuses it, after the event is recorded (and the cell frozen)."""

    name = "seccomp"

    def __init__(self, watch: SeccompWatch, procs: CellProcs, cell: str) -> None:
        self.watch, self.procs, self.cell = watch, procs, cell
        self._held: list[dict[str, Any]] = []

    def fileno(self) -> int:
        return self.watch.fileno()

    def read(self) -> list[CellEvent]:
        if not select.select([self.watch], [], [], 0)[0]:  # (a receive waits for a notification)
            return []
        out = []
        for n in self.watch.read():
            op, target, reason = describe(n["call"], n["args"])
            self.procs.refresh()  # the caller's parents may have forked since the connector was read (it waits)
            out.append(CellEvent(op, target, reason, source="seccomp", cell=self.cell, pid=n["pid"],
                                 exe=n.get("exe", ""), allow="nothing: a cell never gets this call",
                                 acts=n["call"] not in NOTED))
            self._held.append(n)
        return out

    def release(self) -> None:
        held, self._held = self._held, []
        for n in held:
            self.watch.refuse(n)  # now the call fails

    def close(self) -> None:
        self.watch.close()
