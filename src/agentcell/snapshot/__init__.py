"""Snapshots (:mod:`.store`): preflight backups the session takes before an agent runs, exact restores,
and what changed since; ``agentcell snapshot``."""
from __future__ import annotations

from .store import SnapshotError, Store, default_store

__all__ = ["SnapshotError", "Store", "default_store"]
