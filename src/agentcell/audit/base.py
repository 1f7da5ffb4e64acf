"""What the trail (:mod:`.trail`) and its seal (:mod:`.seal`) share: the error that stops whatever was to
be recorded, the lock every writer takes on the trail, and a directory's fsync."""
from __future__ import annotations

import fcntl
import os
import time

from ..errors import AgentcellError

LOCK_WAIT_S = 10.0  # a writer holding the lock longer is stuck (or hostile): give up, loudly


class AuditWriteError(AgentcellError):
    """The record could not be written after its retries: whatever was to be recorded must not go on."""

    exit_code = 70  # EX_SOFTWARE-like: distinct from a refusal (125) or a launch failure (123)


def lock(fd: int, how: int = fcntl.LOCK_EX) -> None:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(f"the log stayed locked for {LOCK_WAIT_S:g} s") from None
            time.sleep(0.01)


def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
