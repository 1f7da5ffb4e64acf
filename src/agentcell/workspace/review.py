"""Review: the change set against the session's base, path by path, with the agent's commits, what
would conflict, what git ignores and what decides execution; the audit trail's record of it."""
from __future__ import annotations

import os
import stat
import subprocess
from typing import Any

from .changes import changes
from .controls import _bare_in_view, _bare_shaped, _targets, control
from .gitbranch import _blob_id, _commit_files, _committed, _git, agent_head, commits, git_problem
from .owner import as_owner
from .store import WorkspaceError, _record, _upper, load
from .tree import _lstat


def review(session: str, diffs: bool = False) -> dict[str, Any]:
    """The change set against the session's base (as the project's owner): every path, the agent's
    commits, what would conflict; ``diffs``: a unified diff of each changed text."""
    meta = load(session)
    out: dict[str, Any] = as_owner(meta, _review, meta, diffs)
    return out


def _review(meta: dict[str, Any], diffs: bool = False) -> dict[str, Any]:
    found = changes(meta)
    problem = git_problem(meta) if meta.get("git") is not None else None
    head = agent_head(meta, problem)
    targets = _targets(meta)
    repos = _bare_in_view(meta, [p for c in found for p in (c["path"], c.get("from")) if p])
    committed = _committed(meta, head)
    fmt = (meta.get("git") or {}).get("object_format", "sha1")
    upper = _upper(meta)
    for c in found:
        if head is None or c.get("special"):
            c["committed"] = False
        elif c["change"] == "deleted":
            c["committed"] = c["path"] not in committed
        else:
            c["committed"] = committed.get(c["path"]) == _blob_id(os.path.join(upper, c["path"]), fmt)
        c["conflict"] = c["human_changed"] and not c["same"] and not c["committed"]
        c["control"] = control(meta["project"], c["path"], targets, repos) or (
            control(meta["project"], c["from"], targets, repos) if c.get("from") else None)
        if diffs and c["change"] in ("modified", "added", "renamed", "type") and not c.get("special"):
            c["diff"] = _diff_text(meta, c["path"], c.get("from"), c.get("hidden", False))
    if meta.get("git") is not None:  # what the agent made that the project's git ignores (build output)
        for c in found:
            c["ignored"] = False
        made = [c for c in found if c["change"] == "added"]
        if made:
            ignored = _ignored_paths(meta["project"], [c["path"] for c in made])
            for c in made:
                c["ignored"] = c["path"] in ignored
    found_commits = commits(meta, head)
    for cm in found_commits:
        cm["files"] = _commit_files(meta, cm["commit"])
        shaped = _bare_shaped(cm["files"])
        cm["control"] = sorted({p for f in cm["files"] if (p := control(meta["project"], f, targets, shaped))})
    return {"session": meta["session"], "project": meta["project"], "state": meta["state"],
            "base": {"time_ns": meta["base_ns"], "commit": (meta.get("git") or {}).get("head")},
            "branch": f"agentcell/{meta['session']}" if head else None, "head": head, "commits": found_commits,
            "git_problem": problem,
            "changes": found, "hidden": meta.get("hidden", [])}


def _ignored_paths(project: str, paths: list[str]) -> set[str]:
    """Which of ``paths`` the project's git ignores. A path git will not judge (beyond a link in the
    project, inside a submodule) is asked about alone, and counts as not ignored if git still refuses."""
    me = (os.geteuid(), os.getegid())
    try:
        out = _git(project, me, "check-ignore", "-z", "--stdin", input=b"\0".join(os.fsencode(p) for p in paths)
                   + b"\0", ok=(0, 1))
        return {os.fsdecode(p) for p in out.split(b"\0") if p}
    except WorkspaceError:
        pass
    # (check-ignore prints the path only when it is ignored; 128: git refused to judge it)
    return {p for p in paths if _git(project, me, "check-ignore", "--", p, ok=(0, 1, 128))}


def record_review(r: dict[str, Any]) -> None:
    """The audit trail's record of a review: what the human was shown."""
    meta = load(r["session"])
    _record(meta, "session.review", state=r["state"], changes=len(r["changes"]), commits=len(r["commits"]),
            conflicts=[c["path"] for c in r["changes"] if c["conflict"]], base=r["base"])


def _diff_text(meta: dict[str, Any], rel: str, was: str | None = None, hidden: bool = False) -> str:
    """A unified diff of one changed path: the project's (``was``: the renamed path's) against the agent's.
    A path the view hid is shown against nothing: the project's file there is not the agent's to see,
    nor the review's to print."""
    a, b = os.path.join(meta["project"], was or rel), os.path.join(_upper(meta), rel)
    p = subprocess.run(["diff", "-u", "--label", f"a/{_label(was or rel)}", "--label", f"b/{_label(rel)}",
                        a if not hidden and _regular(a) else "/dev/null", b if _regular(b) else "/dev/null"],
                       capture_output=True, timeout=60)
    return p.stdout.decode(errors="replace")


def _label(rel: str) -> str:
    """A path as a diff's header may show it: no line break or control character the agent put in a name."""
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in rel)


def _regular(path: str) -> bool:
    st = _lstat(path)
    return st is not None and stat.S_ISREG(st.st_mode)
