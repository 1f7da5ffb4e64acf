"""PID 1 of the cell: a small reaper that forwards signals and exits with the command's status.

It is the only process the command cannot see (``hidepid=invisible``, non-dumpable, another uid in
root mode), it reaps orphans, and when the command ends it kills and reaps every process still left
in the cell's PID namespace, reports the status, and exits.
"""
from __future__ import annotations

import os

from .spec import TYPE_CHECKING

if TYPE_CHECKING:
    import signal
    from collections.abc import Callable
    from typing import NoReturn
else:  # signal.py only wraps _signal in IntEnums, whose import costs ~6 ms per agentcell run here
    import _signal as signal

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


def block_signals() -> set[int]:
    """Called first thing in PID 1: signals sent before the command exists wait (pending) instead of
    killing or being lost; :func:`run` forwards them. Returns the mask the command must get back."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)


def run(start_command: Callable[[], NoReturn], report: Callable[[int, int], None],
        close_after_fork: list[int], command_mask: set[int]) -> NoReturn:
    """Fork the command (``start_command`` runs in the child), then reap and forward until it exits.

    ``close_after_fork``: the hand-off channel, which only the command's process may hold.
    """
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, command_mask)
        start_command()
    for fd in close_after_fork:
        os.close(fd)
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
    # The command is done: nothing else of the cell may outlive it. Kill and reap the rest first,
    # so that when the supervisor reads our report the cell is already empty.
    try:
        os.kill(-1, signal.SIGKILL)  # as a namespace's init: every other process in it
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    report(code, sig)
    os._exit(code)
