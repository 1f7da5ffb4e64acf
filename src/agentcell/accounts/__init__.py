"""Agent accounts: a UNIX user per agent (persistent, ``agentcell agent …``) or per session (ephemeral).

Everything ``au`` (agent-as-unix-user) does — user and group, home shared through group ACLs,
folder shares, health check, delete — with privilege from root only (no setuid helper), paths
resolved without untrusted symlinks and re-checked at each run, every change a printed command, and
a delete that works from any partial state. The agent runs only inside a cell (:mod:`agentcell.cell`).

Modules: :mod:`.registry` (the record), :mod:`.accounts` (persistent agents), :mod:`.acl` (shares),
:mod:`.ephemeral` (per-session accounts: ``create_ephemeral(session_id)``, ``delete(account)``),
:mod:`.commands` (printed privileged commands), :mod:`.running` (what each run of an agent checks and is
given), :mod:`.status` (the listing and health report). Names are imported from them on first use, so
``agentcell agent run`` loads only the record.
"""
from __future__ import annotations

TYPE_CHECKING = False  # not typing's: see cell/spec.py (mypy treats it as true)
if TYPE_CHECKING:
    from .accounts import AccountError, delete, health, mount_add, mount_remove, new
    from .commands import Commands
    from .ephemeral import Account, create_ephemeral, leftovers
    from .registry import AgentRecord, Share, open_registry

_EXPORTS = {
    "AccountError": "accounts", "new": "accounts", "delete": "accounts", "health": "accounts",
    "mount_add": "accounts", "mount_remove": "accounts", "Commands": "commands", "Account": "ephemeral",
    "create_ephemeral": "ephemeral", "leftovers": "ephemeral", "AgentRecord": "registry", "Share": "registry",
    "open_registry": "registry",
}
__all__ = ["Account", "AccountError", "AgentRecord", "Commands", "Share", "create_ephemeral", "delete", "health",
           "leftovers", "mount_add", "mount_remove", "new", "open_registry"]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentcell.accounts' has no attribute {name!r}")
    return getattr(__import__(f"agentcell.accounts.{module}", fromlist=[name]), name)
