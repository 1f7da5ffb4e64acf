"""The terminal: a cell never shares the caller's.

A command that shares its caller's session can type into the caller's terminal with TIOCSTI (on
kernels that allow it) and have the keystrokes run by the caller's shell after the cell is gone, as
root if that shell is root's. So the command always starts a session of its own (setsid), which
leaves it no controlling terminal at all; an interactive run (stdin a terminal whose foreground is
ours) gets a fresh pty instead, whose other end the supervisor relays to the real terminal. TIOCSTI
into that pty reaches only the cell's own input.
"""
from __future__ import annotations

import fcntl
import os
import select

from .spec import TYPE_CHECKING

if TYPE_CHECKING:
    import signal

    from .launch import Running
else:  # signal.py only wraps _signal in IntEnums, whose import costs ~6 ms per agentcell run here
    import _signal as signal

TIOCSCTTY = 0x540E
TIOCGWINSZ = 0x5413
TIOCSWINSZ = 0x5414


def is_ours() -> bool:
    """True when stdin is a terminal whose foreground process group is ours (an interactive run)."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def tty_fds() -> tuple[int, ...]:
    """Which of our 0, 1, 2 are terminals: those get the cell's own pty in an interactive run."""
    return tuple(fd for fd in (0, 1, 2) if os.isatty(fd))


def attach_new_pty(ctl: object, fds: tuple[int, ...]) -> None:
    """In the command's process (its own session, inside the cell): open a pty in the cell's devpts,
    send its master to the supervisor, and make the slave our controlling terminal on ``fds``."""
    from . import handoff

    master, slave = os.openpty()
    try:
        handoff.send_fd(ctl, master)  # type: ignore[arg-type]
    finally:
        os.close(master)
    for fd in fds:
        os.dup2(slave, fd)
    if slave not in fds:
        os.close(slave)
    fcntl.ioctl(fds[0], TIOCSCTTY, 0)  # the controlling terminal; our group becomes its foreground


class Relay:
    """Relays an interactive cell's pty to and from the caller's terminal, in raw mode."""

    def __init__(self, master: int) -> None:
        import termios

        self.master = master
        self.out = 1 if os.isatty(1) else 2 if os.isatty(2) else 1
        termios.tcsetattr(master, termios.TCSANOW, termios.tcgetattr(0))  # the caller's settings
        self._copy_size()

    def _copy_size(self) -> None:
        try:
            fcntl.ioctl(self.master, TIOCSWINSZ, fcntl.ioctl(0, TIOCGWINSZ, b"\0" * 8))
        except OSError:
            pass

    def pump(self, running: Running, deadline: float | None) -> bool:
        """Relay until the cell has ended; True if ``deadline`` passed first (the cell is then killed)."""
        import termios
        import time
        import tty

        resized = [False]
        old_winch = signal.signal(signal.SIGWINCH, lambda _s, _f: resized.__setitem__(0, True))
        saved = termios.tcgetattr(0)
        tty.setraw(0)
        timed_out = False
        stdin_open = True
        try:
            while not (running.finished_reading() or running.reported()):
                if resized[0]:
                    resized[0] = False
                    self._copy_size()
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                readers = [self.master, running.fileno()] + ([0] if stdin_open else [])
                try:
                    ready, _, _ = select.select(readers, [], [], wait)
                except InterruptedError:
                    continue
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out, deadline = True, None
                    running.kill()
                if 0 in ready:
                    data = os.read(0, 65536)
                    if data:
                        _write_all(self.master, data)
                    else:
                        stdin_open = False
                if self.master in ready and not self._forward_output():
                    stdin_open = False
                if running.fileno() in ready:
                    running.poll_messages(0)
            while self._forward_output(nonblocking=True):
                pass
        finally:
            termios.tcsetattr(0, termios.TCSADRAIN, saved)
            signal.signal(signal.SIGWINCH, old_winch)
            os.close(self.master)
        return timed_out

    def _forward_output(self, nonblocking: bool = False) -> bool:
        if nonblocking and not select.select([self.master], [], [], 0)[0]:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every holder of the pty's other end has gone
            return False
        if data:
            _write_all(self.out, data)
        return bool(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
