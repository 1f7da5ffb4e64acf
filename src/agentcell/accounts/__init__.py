"""Agent accounts: a UNIX user per agent (persistent, ``agentcell agent …``) or per session (ephemeral).

Everything ``au`` (agent-as-unix-user) does — user and group, home shared through group ACLs,
folder shares, health check, delete — with privilege from root only (no setuid helper), paths
resolved without untrusted symlinks and re-checked at each run, every change a printed command, and
a delete that works from any partial state. The agent runs only inside a cell (:mod:`agentcell.cell`).
"""
from __future__ import annotations

from .accounts import AccountError, delete, health, mount_add, mount_remove, new
from .commands import Commands
from .ephemeral import Account, create_ephemeral, leftovers
from .ephemeral import delete as delete_ephemeral
from .registry import AgentRecord, Share, open_registry

__all__ = ["Account", "AccountError", "AgentRecord", "Commands", "Share", "create_ephemeral", "delete",
           "delete_ephemeral", "health", "leftovers", "mount_add", "mount_remove", "new", "open_registry"]
