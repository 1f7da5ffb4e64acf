"""The controlling terminal: who holds its foreground, and handing it to the cell and back.

An interactive run (stdin a terminal whose foreground is ours) gives the command's process group the
foreground so a shell in the cell has job control; the supervisor takes it back afterwards.
(Isolating the cell from the host's terminal with its own pty comes with the hardening layer.)
"""
from __future__ import annotations

import os

from .spec import TYPE_CHECKING

if TYPE_CHECKING:
    import signal
else:  # signal.py only wraps _signal in IntEnums, whose import costs ~6 ms per agentcell run here
    import _signal as signal


def is_ours() -> bool:
    """True when stdin is a terminal whose foreground process group is ours (an interactive run)."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def give_to_own_group() -> None:
    """Make the caller's process group the terminal's foreground (from the background: SIGTTOU off)."""
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(0, os.getpgrp())
    except OSError:
        pass
    signal.signal(signal.SIGTTOU, old)


def reclaim() -> None:
    if os.isatty(0) and not is_ours():
        give_to_own_group()
