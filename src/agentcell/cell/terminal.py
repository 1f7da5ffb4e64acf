"""The terminal: a cell never shares the caller's.

A command that shares its caller's session can type into the caller's terminal with TIOCSTI (on
kernels that allow it) and have the keystrokes run by the caller's shell after the cell is gone, as
root if that shell is root's. So the command always starts a session of its own (setsid), which
leaves it no controlling terminal at all, and no terminal from outside ever reaches it: where the
caller's 0, 1 or 2 is a terminal, the cell gets a pty of its own devpts instead, which the supervisor
relays (input too when the run is interactive: stdin a terminal whose foreground is ours). TIOCSTI
into that pty reaches only the cell's own input.
"""
from __future__ import annotations

import fcntl
import os
import select

from ..errors import LaunchError
from .spec import TYPE_CHECKING

if TYPE_CHECKING:
    import signal
    from typing import Protocol

    class Running(Protocol):  # launch.Running, as the relay uses it (launch imports this module)
        def finished_reading(self) -> bool: ...
        def reported(self) -> bool: ...
        def fileno(self) -> int: ...
        def kill(self) -> None: ...
        def poll_messages(self, timeout: float | None) -> None: ...
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


def refuse_foreign(fds: set[int]) -> None:
    """The last gate before exec: no terminal but the cell's own pty may reach the command (a harness
    may pass one by mistake; a terminal no session owns could be taken over with TIOCSCTTY)."""
    cell_pts = os.stat("/dev/pts").st_dev
    for fd in fds:
        if os.isatty(fd) and os.fstat(fd).st_dev != cell_pts:
            raise LaunchError("terminal", f"fd {fd} is a terminal from outside the cell",
                              "agentcell run relays terminals through a pty of the cell's own; give the Python API "
                              "pipes or files")


class Relay:
    """Relays a cell's own pty to the caller's terminal: its output always; the caller's input (with
    the terminal in raw mode) only when the run is interactive, i.e. in the terminal's foreground."""

    def __init__(self, master: int, interactive: bool) -> None:
        import termios

        self.master, self.interactive = master, interactive
        self.term = next(fd for fd in (0, 1, 2) if os.isatty(fd))
        self.out = 1 if os.isatty(1) else 2 if os.isatty(2) else 1
        termios.tcsetattr(master, termios.TCSANOW, termios.tcgetattr(self.term))  # the caller's settings
        self._copy_size()
        os.set_blocking(master, False)  # a cell that reads nothing must not stall us (or --timeout)

    def _copy_size(self) -> None:
        try:
            fcntl.ioctl(self.master, TIOCSWINSZ, fcntl.ioctl(self.term, TIOCGWINSZ, b"\0" * 8))
        except OSError:
            pass

    def pump(self, running: Running, deadline: float | None) -> bool:
        """Relay until the cell has ended; True if ``deadline`` passed first (the cell is then killed)."""
        import termios
        import time
        import tty

        resized = [False]
        old_winch = signal.signal(signal.SIGWINCH, lambda _s, _f: resized.__setitem__(0, True))
        saved = termios.tcgetattr(0) if self.interactive else None
        if self.interactive:
            tty.setraw(0)
        timed_out, stdin_open, pending = False, self.interactive, b""
        try:
            while not (running.finished_reading() or running.reported()):
                if resized[0]:
                    resized[0] = False
                    self._copy_size()
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                readers = [self.master, running.fileno()]
                if stdin_open and len(pending) < 65536:
                    readers.append(0)
                try:
                    ready, writable, _ = select.select(readers, [self.master] if pending else [], [], wait)
                except InterruptedError:
                    continue
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out, deadline = True, None
                    running.kill()
                if writable:
                    try:
                        pending = pending[os.write(self.master, pending):]
                    except BlockingIOError:
                        pass
                    except OSError:
                        pending, stdin_open = b"", False
                if 0 in ready:
                    data = os.read(0, 65536)
                    pending += data
                    stdin_open = bool(data)
                if self.master in ready:
                    self._forward_output()
                if running.fileno() in ready:
                    running.poll_messages(0)
            while self._forward_output():
                pass
        finally:
            if saved is not None:
                termios.tcsetattr(0, termios.TCSADRAIN, saved)
            signal.signal(signal.SIGWINCH, old_winch)
            os.close(self.master)
        return timed_out

    def _forward_output(self) -> bool:
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EAGAIN: nothing now; EIO: every holder of the pty's other end has gone
            return False
        if data:
            _write_all(self.out, data)
        return bool(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
