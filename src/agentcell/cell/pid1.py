"""PID 1 of the cell: a small reaper that forwards signals and exits with the command's status.

It is the only process the command cannot see (``hidepid=invisible``, non-dumpable, another uid in
root mode), it reaps orphans, and when the command ends it exits, which makes the kernel kill every
process still left in the cell's PID namespace.
"""
from __future__ import annotations

import _signal as signal  # see launch.py
import os

from .spec import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import NoReturn

FORWARDED = (
    signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM,
    signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT, signal.SIGWINCH,
)
WAITED = {*FORWARDED, signal.SIGCHLD}


def status_of(wstatus: int) -> tuple[int, int]:
    """(exit code, signal) of a wait status; a signal death maps to 128+N."""
    if os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
        return 128 + sig, sig
    return os.waitstatus_to_exitcode(wstatus), 0


def run(start_command: Callable[[], NoReturn], report: Callable[[int, int], None]) -> NoReturn:
    """Fork the command (``start_command`` runs in the child), then reap and forward until it exits."""
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        start_command()
    code, sig = 255, 0
    while True:
        info = signal.sigwaitinfo(WAITED)
        if info.si_signo != signal.SIGCHLD:
            try:
                os.kill(pid, info.si_signo)
            except ProcessLookupError:
                pass
            continue
        done = False
        while True:
            try:
                child, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if child == 0:
                break
            if child == pid:
                code, sig = status_of(wstatus)
                done = True
        if done:
            break
    report(code, sig)
    os._exit(code)
