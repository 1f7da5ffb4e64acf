"""seccomp: the third wall, loaded last, just before exec.

The deny-list (KERNEL_NOTES): everything a confined agent has no business doing and that widens the
kernel's attack surface or undoes the cell — tracing other processes, mounting, new namespaces,
keyrings, bpf, perf, modules, kexec, file handles, userfaultfd, io_uring, personality changes, and
the terminal ioctls that type into a terminal (TIOCSTI, TIOCLINUX). Denied calls fail with EPERM
(clone3 with ENOSYS: its flags live in memory and cannot be inspected, and libc then falls back to
clone); a call from a foreign architecture (i386, x32) kills the process.

Under the escape monitor (``spec.watch``) the calls that can only be an attempt to leave the cell
(``ESCAPE_CALLS``, namespace flags to clone, the terminal-typing ioctls, AF_VSOCK) are not failed by
the kernel but handed to the supervisor (``SECCOMP_RET_USER_NOTIF``), which reports who tried what and
answers EPERM (see ``agentcell.monitor.seccompwatch``); so are the kernel surfaces ordinary software
tries and copes with (``NOTED_CALLS``: io_uring, keyrings, perf, userfaultfd), recorded as notes.
Why notification and not the audit log: an EPERM the filter asks to log
(``SECCOMP_FILTER_FLAG_LOG``) reaches audit only from a syscall with an audit context, which needs
audit rules on every syscall of the host; a notification costs ~40 µs on the denied call alone,
names the process, and works rootless. clone3 and personality keep their plain errno (libc falls
back; the refused personality flags say nothing). If the supervisor is gone, the kernel fails a
notified call with ENOSYS: still refused.

The filter is compiled with libseccomp (the pyseccomp binding) to a classic BPF program. Importing
and compiling cost ~30 ms, so the program is cached: in-process, and for root in a root-only file
under /var/lib/agentcell (a cell never sees /var). The launch itself only loads bytes.
"""
from __future__ import annotations

import binascii
import ctypes
import errno
import os
import struct

from .. import hostfs
from ..errors import LaunchError
from .spec import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

EPERM_CALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot", "unshare",
    "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "open_by_handle_at", "name_to_handle_at", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "swapon", "swapoff", "reboot", "acct", "quotactl",
    "lookup_dcookie", "vhangup", "syslog",
)
# Refused under the monitor by notification (the rest of EPERM_CALLS: EPERM in every cell).
ESCAPE_CALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot", "unshare",
    "setns", "bpf", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "open_by_handle_at", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "swapon", "swapoff", "reboot", "acct",
)
# Refused under the monitor by notification too, but only noted: software tries these and copes (node's
# libuv probes io_uring at start, krb5 and key helpers use keyrings, profilers perf). What was tried is
# on record; the cell goes on.
NOTED_CALLS = ("keyctl", "add_key", "request_key", "perf_event_open", "userfaultfd", "io_uring_setup")
AF_VSOCK = 40
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                   0x00000080)  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
# personality() flags that switch off protections: ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, ADDR_COMPAT_LAYOUT,
# MMAP_PAGE_ZERO. Any value with one of them is refused, the query (0xffffffff) included: the kernel
# stores any other value whole, so "flag set unless it is the query" cannot be told apart safely.
WEAKENING_PERSONALITIES = (0x0040000, 0x0400000, 0x0200000, 0x0100000)
# Socket families a cell may open: unix, IPv4, IPv6, netlink. Everything else (AF_VSOCK above all: its
# address space is the VM's, not the network namespace's) fails with EAFNOSUPPORT.
ALLOWED_FAMILIES = (1, 2, 10, 16)
# Newer syscalls libseccomp 2.5 has no names for (x86_64 numbers): statmount, listmount,
# lsm_get_self_attr, lsm_set_self_attr, lsm_list_modules, open_tree_attr.
EPERM_NUMBERS_X86_64 = (457, 458, 459, 460, 461, 467)
# Joining a multicast group makes the kernel send IGMP/MLD reports no socket owns (so no uid-keyed
# firewall sees them): a covert channel out of a host-firewall cell. (level, optname) pairs.
MULTICAST_JOINS = ((0, 35), (0, 39), (0, 42), (0, 46), (41, 20), (41, 42), (41, 46))
# A setuid or setgid bit on a file the agent makes: outside the cell (where the file system is not nosuid)
# anyone who runs it gets the account's uid or gid, and through them its grant on the project, while the
# session lasts and past it (a process keeps its ids). (syscall, argument of the mode); open and openat
# only with O_CREAT or O_TMPFILE; openat2's mode is in memory: ENOSYS (libc falls back to openat). The
# chmod calls refuse the setuid bit only: chmod keeps a directory's setgid bit (GNU chmod passes it on
# with any numeric mode), which the filter cannot tell from a file's, and refusing it broke `chmod 700`
# on a shared (setgid) directory.
MODE_CALLS = (("chmod", 1), ("fchmod", 1), ("fchmodat", 2))
CREATE_CALLS = (("creat", 1), ("mknod", 1), ("mknodat", 2))  # (these make files, never directories)
OPEN_MODE_CALLS = (("open", 1, 2), ("openat", 2, 3))  # (syscall, argument of the flags, of the mode)
SET_ID_BITS = (0o4000, 0o2000)  # S_ISUID, S_ISGID
O_CREAT, O_TMPFILE_BIT = 0o100, 0o20000000
FCHMODAT2_X86_64 = 452  # (libseccomp 2.5 has no name for it)
CACHE_DIR = "/var/lib/agentcell/seccomp"
# A Landlock layer of the agent's own would hide its denials from the monitor (the kernel logs only
# the youngest denying layer, with that layer's logging flags, off after an exec by default): a cell
# is confined already, so Landlock is "not there" (ENOSYS) for what runs in it. x86_64 numbers too.
LANDLOCK_CALLS = ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self")
LANDLOCK_NUMBERS_X86_64 = (444, 445, 446)
VERSION = 9  # bump when the rules change: it is part of the cache key

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV = 1, 8, 32
_programs: dict[bool, bytes] = {}


def describe() -> list[str]:
    return [f"EPERM: {', '.join(EPERM_CALLS)}",
            "EPERM: clone with any CLONE_NEW* flag; ioctl TIOCSTI, TIOCLINUX; personality flags that weaken "
            "ASLR or NX; statmount, listmount, lsm_*_self_attr, lsm_list_modules, open_tree_attr",
            "EAFNOSUPPORT: sockets of any family but unix, IPv4, IPv6 and netlink (AF_VSOCK above all)",
            "EPERM: setsockopt joining a multicast group (IGMP/MLD reports leave unowned)",
            "EPERM: a setuid bit given by chmod, fchmod, fchmodat(2); a setuid or setgid bit by creat, "
            "mknod(at), or open(at) creating; ENOSYS: openat2 (its mode is in memory; libc falls back to openat)",
            "ENOSYS: clone3 (flags not inspectable; libc falls back to clone)",
            "ENOSYS: landlock_create_ruleset, landlock_add_rule, landlock_restrict_self (a layer of the agent's "
            "own would hide its denials from the monitor)",
            "KILL: any syscall from a foreign architecture (i386, x32)"]


def _compile(notify: bool) -> bytes:
    import tempfile

    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    deny = sc.ERRNO(errno.EPERM)
    escape = sc.NOTIFY if notify else deny
    for name in EPERM_CALLS:
        try:
            f.add_rule(escape if name in ESCAPE_CALLS or name in NOTED_CALLS else deny, name)
        except (RuntimeError, ValueError, OSError):
            continue  # not a syscall on this architecture
    for flag in NAMESPACE_FLAGS:
        f.add_rule(escape, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for i, name in enumerate(LANDLOCK_CALLS):
        try:
            f.add_rule(sc.ERRNO(errno.ENOSYS), name)
        except (RuntimeError, ValueError, OSError):  # a libseccomp without its name
            if os.uname().machine == "x86_64":
                f.add_rule(sc.ERRNO(errno.ENOSYS), LANDLOCK_NUMBERS_X86_64[i])
    for request in (TIOCSTI, TIOCLINUX):
        f.add_rule(escape, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    for flag in WEAKENING_PERSONALITIES:
        f.add_rule(deny, "personality", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    for call in ("socket", "socketpair"):
        f.add_rule(no_family, call, sc.Arg(0, sc.GT, max(ALLOWED_FAMILIES)))  # also any high bits
        for family in range(max(ALLOWED_FAMILIES)):
            if family not in ALLOWED_FAMILIES:
                f.add_rule(escape if notify and family == AF_VSOCK else no_family, call, sc.Arg(0, sc.EQ, family))
    for level, optname in MULTICAST_JOINS:
        f.add_rule(deny, "setsockopt", sc.Arg(1, sc.EQ, level), sc.Arg(2, sc.EQ, optname))
    for bit in SET_ID_BITS:
        for name, arg in (*CREATE_CALLS, *(MODE_CALLS if bit == 0o4000 else ())):
            f.add_rule(deny, name, sc.Arg(arg, sc.MASKED_EQ, bit, bit))
        for name, flags, mode in OPEN_MODE_CALLS:
            for creating in (O_CREAT, O_TMPFILE_BIT):
                f.add_rule(deny, name, sc.Arg(flags, sc.MASKED_EQ, creating, creating),
                           sc.Arg(mode, sc.MASKED_EQ, bit, bit))
        if os.uname().machine == "x86_64" and bit == 0o4000:
            f.add_rule(deny, FCHMODAT2_X86_64, sc.Arg(2, sc.MASKED_EQ, bit, bit))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "openat2")
    if os.uname().machine == "x86_64":
        for nr in EPERM_NUMBERS_X86_64:
            f.add_rule(deny, nr)
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def _key(notify: bool) -> str:
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_version.restype = ctypes.POINTER(ctypes.c_uint * 3)
    ver = tuple(lib.seccomp_version().contents)
    text = repr((VERSION, notify, EPERM_CALLS, ESCAPE_CALLS, NOTED_CALLS, NAMESPACE_FLAGS, WEAKENING_PERSONALITIES,
                 ALLOWED_FAMILIES, EPERM_NUMBERS_X86_64, MULTICAST_JOINS, ver, os.uname().machine))
    return f"v{VERSION}-{binascii.crc32(text.encode()):08x}"  # a key, not a defence: the dir is root's


ROOT = hostfs.ROOT


def _trusted_root_file(path: str) -> bool:
    return all(hostfs.changeable_only_by(os.lstat(p), ROOT) for p in (path, os.path.dirname(path)))


def _store(path: str, prog: bytes) -> None:
    """Cache the program for root, only where nobody else can write, whatever the umask."""
    d = "/"
    for part in CACHE_DIR.strip("/").split("/"):
        d = os.path.join(d, part)
        try:
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700 if d == CACHE_DIR else 0o755)
        except FileExistsError:
            pass
        if not hostfs.changeable_only_by(os.lstat(d), ROOT):
            return  # someone else could write here: keep the program in memory only
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, prog)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def program(notify: bool = False) -> bytes:
    """The compiled filter: from memory, from root's cache, or compiled now (and cached for root).
    ``notify``: escape calls go to the supervisor (the monitor's variant)."""
    prog = _programs.get(notify)
    if prog is None:
        prog = _programs[notify] = _load_or_compile(notify)
    return prog


def _load_or_compile(notify: bool) -> bytes:
    prog: bytes | None = None
    try:
        path = os.path.join(CACHE_DIR, _key(notify) + ".bpf")
    except OSError as e:
        raise LaunchError("seccomp", f"libseccomp is missing ({e})", "apt-get install libseccomp2") from None
    if os.geteuid() == 0:
        try:
            if _trusted_root_file(path):
                with open(path, "rb") as f:
                    prog = f.read()
        except OSError:
            pass
    if prog is None:
        try:
            prog = _compile(notify)
        except ImportError:
            raise LaunchError("seccomp", "the pyseccomp binding is missing", "pip install pyseccomp") from None
        if os.geteuid() == 0:
            _store(path, prog)
    if not prog or len(prog) % 8:
        raise LaunchError("seccomp", "the compiled filter is malformed")
    return prog


def load(prog: bytes, *, listen: bool = False) -> int | None:
    """Install the filter on the calling process (no_new_privs is already set); it survives exec.
    ``listen``: the notify variant; returns its listener fd (for the supervisor)."""
    return ready(prog, listen=listen)()


def ready(prog: bytes, *, listen: bool = False) -> Callable[[], int | None]:
    """:func:`load`, made ready: the program's buffer, its sock_fprog and libc's entry point are built now
    (a prepared cell's command process does so before its command comes: 0.6 ms a command here), and the
    function returned only makes the call."""
    nr = SYS_SECCOMP.get(os.uname().machine)
    if listen and nr is None:
        raise LaunchError("seccomp", f"no seccomp syscall number known for {os.uname().machine}",
                          "run without --monitor")
    return _Loader(prog, nr or 0, listen).load


class _Loader:
    def __init__(self, prog: bytes, nr: int, listen: bool) -> None:
        self.buf = ctypes.create_string_buffer(prog, len(prog))  # (held here while the call may come)
        self.fprog = ctypes.c_char_p(struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(self.buf)))
        libc = ctypes.CDLL(None, use_errno=True)
        self.prctl, self.syscall, self.nr, self.listen = libc.prctl, libc.syscall, nr, listen

    def load(self) -> int | None:
        if not self.listen:
            if self.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, self.fprog, 0, 0) != 0:
                raise LaunchError("seccomp", f"loading the filter: {os.strerror(ctypes.get_errno())}")
            return None
        # WAIT_KILLABLE_RECV (5.19+): once the monitor has received a call, a signal cannot pull it
        # back out unrecorded (EINTR); only a fatal one ends the wait.
        for flags in (SECCOMP_FILTER_FLAG_NEW_LISTENER | SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV,
                      SECCOMP_FILTER_FLAG_NEW_LISTENER):
            fd = self.syscall(ctypes.c_long(self.nr), ctypes.c_long(SECCOMP_SET_MODE_FILTER), ctypes.c_long(flags),
                              self.fprog)
            if fd >= 0 or ctypes.get_errno() != errno.EINVAL:
                break
        if fd < 0:
            err = ctypes.get_errno()
            hint = ("an outer seccomp filter already has a listener (a monitored cell inside another)"
                    if err == errno.EBUSY else "")
            raise LaunchError("seccomp", f"loading the filter with a listener: {os.strerror(err)}", hint)
        return int(fd)
