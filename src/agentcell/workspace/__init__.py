"""Copy-on-write workspaces (``session start --workspace copy``): the agent works on a view of the
project whose writes land in the session's own change set; the human's tree and ``.git`` are never
written until ``apply``.

Store (agentcell's state directory; root's for root's sessions, the user's XDG state for a user's)::

    <state dir>/workspaces/                 0711 (entered by name, not listed)
    <state dir>/workspaces/<session>/       0711, agentcell's: meta.json (the base, the state), base.names
    <state dir>/workspaces/<session>/cs/    0700, the project owner's: the change set
        upper/   overlayfs's upper layer (the session's account's while it runs, the owner's after)
        work/    overlayfs's scratch (same file system as upper)
        hide/    whiteouts for what the view leaves out: files git ignores (unless named with
                 --workspace-include) and the masked paths
        apply.json   the journal of an apply in progress

**Who does what.** Review and apply run as the project's owner (root forks and drops to them): what
they read and write in the project, the owner could read and write themselves, so a link planted in
the project by anyone leads nowhere the owner could not go. Only the records (meta.json, the audit
trail) are written by agentcell itself.

What the kernel does (:class:`agentcell.cell.spec.Workspace`, :mod:`agentcell.cell.mounts`): the
project is the read-only lower layer, idmapped so that its owner shows as the session's account. Start-up
costs nearly the same for any number of files: no content is copied.

**The base.** A session starts from the project as it is at ``base_ns`` (the kernel's coarse clock, the
one file times are taken from) and, for git, from the commit HEAD names then. No content is copied: the
names of its files and their inode numbers are listed from the directories (``base.names``), and a path
is still the base's while it is the same inode with a change time (ctime, which no one but root can set
back) before ``base_ns``; otherwise the human changed, replaced, deleted or made it since. ``apply`` is
a three-way merge by file: what only the agent changed lands; what only the human changed stays; what
both changed is a conflict, refused and named (unless both made it the same), nothing written.
``--ours PATH`` keeps the human's, ``--theirs PATH`` takes the agent's.

**What decides execution** (a ``.git`` anywhere but a repository's own, hooks, ``.envrc``, harness and
editor config, ``.gitattributes``: :func:`agentcell.protect.surface.protected_part`) is flagged in review and
never applied unless named with ``--theirs``: the quarantine of a direct session, by consent.

**Git.** The agent's commits come as a branch, ``agentcell/<session>``, packed from the change set and
indexed into the human's repository by git's plumbing run as the human (no hook, no configuration of the
agent's runs); what the agent left uncommitted lands in the tree as above. Nothing of the agent's
``.git`` (its config, hooks, index) is copied. A ``.git`` the agent replaced by a link, or whose objects
it points elsewhere (alternates, links), gives no branch: its commits are refused.

**Nothing is lost until discard.** The change set is on disk from the start: a supervisor killed
mid-session, or a reboot, leaves it reviewable and applicable; ``recover`` never removes one; only
``discard`` does.

**The modules**: :mod:`.store` (a session's entry: meta.json, base.names, the apply lock, the audit
records), :mod:`.create` (the entry and the layers at the start), :mod:`.tree` (walking a layer by
entry), :mod:`.changes` (what the agent changed, against the base), :mod:`.gitbranch` (git run as the
human or on the change set: the agent's commits and their branch), :mod:`.controls` (what decides
execution), :mod:`.review`, :mod:`.apply` (the journal and its commit point; discard), :mod:`.owner`
(a step run as the project's owner).
"""
from __future__ import annotations

from .apply import apply, discard
from .create import create
from .owner import give_back
from .review import record_review, review
from .store import WorkspaceError, listing, path_of

__all__ = ["WorkspaceError", "apply", "create", "discard", "give_back", "listing", "path_of", "record_review",
           "review"]
