"""What the parts of snapshots share: their error, the progress callback, and a path as a manifest
writes it (the hex of its bytes: any name, any encoding)."""
from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import AgentcellError

Progress = Callable[[int, int], None]  # (done, total) bytes or entries


class SnapshotError(AgentcellError):
    pass


def _hexpath(rel: str) -> str:
    return os.fsencode(rel).hex()


def _unhex(h: str) -> str:
    return os.fsdecode(bytes.fromhex(h))
