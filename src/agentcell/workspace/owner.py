"""A step run as the project's owner: root forks, shows the child the change set in a mount namespace
of its own, and drops to the owner; and the account's files handed to the owner at a session's end."""
from __future__ import annotations

import json
import os
from typing import Any

from .. import hostfs
from ..errors import AgentcellError, forked
from .changes import marks
from .store import WorkspaceError, _base_names, _cs, _upper, load

VIEW_OVER = ("/run", "/mnt", "/media", "/srv")  # (as_owner: where the owner's view of the change set goes)


def as_owner(meta: dict[str, Any], fn: Any, *args: Any) -> Any:
    """``fn(*args)`` as the project's owner: in a child that root forks and drops to the owner (no
    supplementary group), its result (JSON) or its error handed back. Run directly when we are them."""
    uid, gid = int(meta["owner"][0]), int(meta["owner"][1])
    if os.geteuid() != 0 or uid == 0:
        return fn(*args)
    meta["marks"] = marks(meta)  # (trusted.* xattrs: root reads them for the owner)
    meta["base_names"] = _base_names(meta)  # (in agentcell's directory, which the owner cannot enter)
    over = next((d for d in VIEW_OVER if os.path.isdir(d) and not hostfs.within(meta["project"], d)
                 and not hostfs.within(os.path.realpath(_cs(meta)), d)), None)
    if over is None:
        raise WorkspaceError("workspace", f"no place to show the change set to its owner (none of "
                             f"{', '.join(VIEW_OVER)} is a directory outside the project and the state)", "")
    cs = _cs(meta)  # (in agentcell's own directory: its name cannot be swapped by the owner)
    r, w = os.pipe2(os.O_CLOEXEC)
    with forked() as pid:
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(r)
                # The state directory above the change set need not be the owner's to enter (and git
                # resolves every path to its real one): in a mount namespace of the child's own, a tmpfs
                # over a directory the project is not in (/run, say) holds the change set, bound there;
                # nothing outside the child sees either, and nothing is left on the host.
                from ..cell import syscalls as sc

                try:
                    sc.unshare(sc.CLONE_NEWNS)
                    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
                    sc.mount("tmpfs", over, "tmpfs", sc.MS_NOSUID | sc.MS_NODEV, "mode=0755,size=64k")
                    view = os.path.join(over, "agentcell-change-set")
                    os.mkdir(view, 0o755)
                    sc.mount(cs, view, None, sc.MS_BIND)
                    meta["cs"] = view
                    os.setgroups([])
                    os.setresgid(gid, gid, gid)
                    os.setresuid(uid, uid, uid)
                    out = {"ok": fn(*args)}
                except AgentcellError as e:
                    out = {"error": [e.field, e.problem, e.fix]}
                except OSError as e:
                    out = {"error": ["workspace", f"{e.filename or ''}: {e.strerror}; nothing was written (what had "
                                     "been was put back)", "fix the cause and try again"]}
                except Exception as e:  # noqa: BLE001 - said, not lost with the child
                    out = {"error": ["workspace", f"{type(e).__name__}: {e}", "report this as a bug"]}
                with os.fdopen(w, "w") as f:
                    json.dump(out, f)
                code = 0
            finally:
                os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    if not text:
        raise WorkspaceError("workspace", "the step run as the project's owner ended without a word", "")
    got = json.loads(text)
    if "error" in got:
        raise WorkspaceError(*got["error"])
    return got["ok"]


def give_back(session: str, uid: int, gid: int) -> list[str]:
    """At the end of a session: what its account made in the change set becomes the project owner's
    (before an ephemeral account's number is freed), as it would be had the agent worked in the project
    itself. What could not be handed over."""
    from ..accounts import acl
    from ..accounts.commands import Commands

    meta = load(session)
    owner = (int(meta["owner"][0]), int(meta["owner"][1]))
    if (uid, gid) == owner:
        return []
    return acl.reassign(Commands(), uid, gid, owner[0], owner[1], _upper(meta))
