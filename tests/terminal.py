"""A terminal for tests that play the person at the keyboard (pty.fork), and what an agent would type
into someone else's terminal. Shared by the launcher's and the session's terminal tests."""
from __future__ import annotations

import os

# Run in a cell: push a command into the controlling terminal (TIOCSTI). The caller's shell must not
# read it afterwards; "STI-REFUSED <errno>" when the kernel or the cell refuses.
TIOCSTI_ATTACK = """
import fcntl, os, termios
print("TTY", os.ttyname(1) if os.isatty(1) else "-")
fd = os.open("/dev/tty", os.O_RDWR) if os.path.exists("/dev/tty") else 0
for c in b"echo INJECTED\\n":
    try:
        fcntl.ioctl(fd, termios.TIOCSTI, bytes([c]))
    except OSError as e:
        print("STI-REFUSED", e.errno)
        break
"""


def read_until(fd: int, needle: bytes, limit_s: float = 20) -> bytes:
    import select
    import time

    out = b""
    end = time.monotonic() + limit_s
    while needle not in out and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


class OnTerminal:
    """argv run on a new terminal (pty.fork): the test is the person at the keyboard. The process is
    killed and reaped on leaving, whatever happened."""

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            if cwd is not None:
                os.chdir(cwd)
            os.execve(argv[0], argv, os.environ if env is None else env)
        self.status = -1

    def wait(self, nohang: bool = False) -> bool:
        done, status = os.waitpid(self.pid, os.WNOHANG if nohang else 0)
        if done:
            self.pid, self.status = 0, status
        return bool(done)

    def __enter__(self) -> OnTerminal:
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)
