"""The audit trail (:mod:`.trail`): append-only, hash-chained JSON lines; ``agentcell audit``."""
from __future__ import annotations

from .trail import AuditLog, AuditWriteError, Verdict, default_path, records, verify

__all__ = ["AuditLog", "AuditWriteError", "Verdict", "default_path", "records", "verify"]
