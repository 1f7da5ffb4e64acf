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
        with open("/proc/self/loginuid") as f:
            if f.read().strip() != "4294967295":
                return  # already the human's login uid, and immutable for the command
        with open("/proc/self/loginuid", "w") as f:
            f.write(str(uid))
    except OSError:
        pass  # no audit in this kernel


def drop(ident: Identity) -> None:
    if not ident.userns:
        _pin_loginuid(ident.uid)
        os.setgroups(list(ident.groups))
        os.setresgid(ident.gid, ident.gid, ident.gid)
    for cap in range(LAST_CAP + 1):
        sc.prctl(sc.PR_CAPBSET_DROP, cap)
    sc.prctl(sc.PR_CAP_AMBIENT, sc.PR_CAP_AMBIENT_CLEAR_ALL)
    os.setresuid(ident.uid, ident.uid, ident.uid)
    sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)
    sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
    if os.getresuid() != (ident.uid,) * 3 or (not ident.userns and 0 in (*os.getresuid(), *os.getresgid())):
        raise LaunchError("identity", f"could not become uid {ident.uid}; refusing to run as root")
