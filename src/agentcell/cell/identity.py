"""Identity: become the cell's account for good, with no way back to privilege.

Order matters: the bounding set can only be dropped while we still hold CAP_SETPCAP (before
setresuid); setresuid clears PR_SET_PDEATHSIG, so it is armed again afterwards; no_new_privs last,
so neither setuid binaries nor file capabilities can raise privilege after exec.
"""
from __future__ import annotations

import os

from ..errors import LaunchError
from . import syscalls as sc
from .spec import TYPE_CHECKING, Identity

if TYPE_CHECKING:
    import signal
else:  # signal.py only wraps _signal in IntEnums, whose import costs ~6 ms per agentcell run here
    import _signal as signal


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 63


LAST_CAP = _last_cap()  # read once, at import (the supervisor), not in every command process


def _pin_loginuid(uid: int) -> None:
    """An unset audit login uid could be set by the command itself, to 0: set it to the agent's."""
    try:
        fd = os.open("/proc/self/loginuid", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return  # no audit in this kernel
    try:
        if os.read(fd, 16).strip() == b"4294967295":  # else already the human's, and immutable for the command
            os.pwrite(fd, str(uid).encode(), 0)
    except OSError:
        pass
    finally:
        os.close(fd)


def ready(ident: Identity) -> None:
    """What of :func:`drop` needs no command, done by a prepared cell's command process before its command
    comes (about 1 ms a command here): the audit login uid pinned to the agent's; the capability bounding
    set and the ambient set emptied, so nothing this process execs can gain a capability. It keeps its
    own capabilities (and CAP_SETPCAP, which this needs) until :func:`drop`."""
    if not ident.userns:
        _pin_loginuid(ident.uid)
    for cap in range(LAST_CAP + 1):
        sc.prctl(sc.PR_CAPBSET_DROP, cap)
    sc.prctl(sc.PR_CAP_AMBIENT, sc.PR_CAP_AMBIENT_CLEAR_ALL)


def drop(ident: Identity, *, readied: bool = False) -> None:
    """Become ``ident`` for good; ``readied``: :func:`ready` was called already."""
    if not readied:
        ready(ident)
    if not ident.userns:
        os.setgroups(list(ident.groups))
        os.setresgid(ident.gid, ident.gid, ident.gid)
    os.setresuid(ident.uid, ident.uid, ident.uid)
    sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)
    sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
    if os.getresuid() != (ident.uid,) * 3 or (not ident.userns and 0 in (*os.getresuid(), *os.getresgid())):
        raise LaunchError("identity", f"could not become uid {ident.uid}; refusing to run as root")
