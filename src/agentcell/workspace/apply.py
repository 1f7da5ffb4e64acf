"""Apply: the change set lands in the project as it is now, all of it or nothing (a three-way merge
by file against the base, conflicts and what decides execution refused unless named), behind a journal
whose commit point decides whether a cut-short apply is rolled back or finished; and discard."""
from __future__ import annotations

import json
import os
import stat
import time
from typing import Any

from .changes import _seen
from .gitbranch import _fetch_branch
from .owner import as_owner
from .review import _review
from .store import WorkspaceError, _cs, _locked, _record, _save, _upper, load

JOURNAL = "apply.json"


def apply(session: str, ours: tuple[str, ...] | list[str] = (), theirs: tuple[str, ...] | list[str] = ()
          ) -> dict[str, Any]:
    """Land the change set in the project as it is now: all of it or nothing. Returns what landed."""
    meta = load(session)
    if meta["state"] != "open":
        raise WorkspaceError("SESSION", f"session {session}'s workspace is {meta['state']}",
                             "'agentcell session review' shows what it held")
    with _locked():
        meta = load(session)  # (again: another apply may have finished while this one waited)
        if meta["state"] != "open":
            raise WorkspaceError("SESSION", f"session {session}'s workspace is {meta['state']}", "")
        out = as_owner(meta, _apply_as_owner, meta, list(ours), list(theirs))
    meta["state"], meta["applied"] = "applied", {"at": time.time(), **out}
    _save(meta)
    _record(meta, "session.apply", paths=out["landed"], branch=out["branch"], head=out["head"], base=out["base"],
            kept_ours=sorted(ours), took_theirs=sorted(theirs))
    return {"session": session, **out}


def _apply_as_owner(meta: dict[str, Any], ours: list[str], theirs: list[str]) -> dict[str, Any]:
    roll_back(meta)  # an apply cut short before (a crash): its journal puts the project back first
    r = _review(meta)
    ours_s, theirs_s = set(ours), set(theirs)
    unknown = (ours_s | theirs_s) - {c["path"] for c in r["changes"]}
    if unknown:
        raise WorkspaceError("--ours/--theirs", f"{sorted(unknown)[0]} is not among the session's changes",
                             f"'agentcell session review {meta['session']}' lists them")
    special = [c["path"] for c in r["changes"] if c.get("special") and c["path"] not in ours_s]
    if special:
        raise WorkspaceError("apply", f"the agent made {special[0]}, which is neither a file, a link nor a "
                             "directory; nothing was written", f"discard the session, or keep yours: --ours "
                             f"{special[0]}")
    # What git ignores that the agent made (a __pycache__, node_modules) stays in the change set unless asked for.
    todo = [c for c in r["changes"] if not c["committed"] and c["path"] not in ours_s and not c["same"]
            and (not c.get("ignored") or c["path"] in theirs_s)]
    conflicts = [c["path"] for c in todo if c["conflict"] and c["path"] not in theirs_s]
    if conflicts:
        raise WorkspaceError("apply", f"{len(conflicts)} path(s) changed in the project since the session began, "
                             f"and by the agent too: {', '.join(conflicts[:10])}{' …' if len(conflicts) > 10 else ''};"
                             " nothing was written",
                             "keep yours with --ours PATH or take the agent's with --theirs PATH, per path")
    # What decides execution lands only by consent: the quarantine of a direct session, asked first.
    controls = [c["path"] for c in todo if c.get("control") and c["path"] not in theirs_s]
    if controls:
        raise WorkspaceError("apply", f"the agent changed {', '.join(controls[:5])}"
                             f"{' …' if len(controls) > 5 else ''}, which decides what git, your shell or your agent "
                             "runs; nothing was written",
                             f"read it (agentcell session review {meta['session']} --diff), then take it with "
                             f"--theirs {controls[0]} or leave it with --ours {controls[0]}")
    # The branch first: it does not touch the tree, and a repository git's plumbing refuses must fail
    # the apply before anything of it lands.
    branch = _fetch_branch(meta, r["head"]) if r["head"] else None
    landed, left = _land(meta, todo)
    warnings = [f"{a} was left behind (remove it by hand)" for a in left]
    for cm in r["commits"]:
        if cm["control"]:
            warnings.append(f"commit {cm['commit'][:12]} changes {', '.join(cm['control'])}, which decides what git, "
                            f"your shell or your agent runs: read it before you merge {branch}")
    if r.get("git_problem"):
        warnings.append(f"the agent's commits were not taken: {r['git_problem']}")
    return {"landed": landed, "branch": branch, "head": r["head"], "base": r["base"], "warnings": warnings}


def _land(meta: dict[str, Any], todo: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Write the agent's version of each path into the project, behind a journal: each original is
    renamed aside next to itself first, so a failure (or a crash: the next apply or discard rolls
    back) leaves the project as it was. Once every write is done the journal says so (committed): from
    then on the originals only go, and one that cannot is left and named, never put back over the
    new. Every directory is walked by descriptor, never through a link. Returns (what landed, what
    was left behind)."""
    upper = _upper(meta)
    writes: list[tuple[str, str]] = []
    seen: dict[str, list[int] | None] = {}
    for c in todo:
        if c["change"] == "renamed":
            writes += [("delete", c["from"]), ("write", c["path"])]
            seen[c["from"]] = c.get("from_seen")
        elif c["change"] == "deleted":
            writes.append(("delete", c["path"]))
        else:
            writes.append(("write", c["path"]))
        seen.setdefault(c["path"], c.get("seen"))
    journal: dict[str, Any] = {"ops": [], "dirs": []}
    jpath = os.path.join(_cs(meta), JOURNAL)
    top = os.open(meta["project"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for i, (what, rel) in enumerate(writes):
            dfd = _dir_fd(top, os.path.dirname(rel), what == "write", journal, jpath)
            try:
                name, aside = os.path.basename(rel), f".agentcell-aside-{meta['session']}-{i}"
                now = _lstat_at(name, dfd)
                if _seen(now) != seen.get(rel):  # the human changed it since the review of the change set
                    raise WorkspaceError("apply", f"{rel} changed while the apply ran; nothing was written",
                                         "apply again")
                journal["ops"].append([rel, aside if now is not None else "", what == "write", None])
                _write_journal(jpath, journal)
                if now is not None:
                    os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
                if what == "write":
                    _copy_in(os.path.join(upper, rel), name, dfd)
                    journal["ops"][-1][3] = os.lstat(name, dir_fd=dfd).st_ino
                    _write_journal(jpath, journal)
            finally:
                os.close(dfd)
        journal["committed"] = True
        _write_journal(jpath, journal)
    except BaseException:
        os.close(top)
        roll_back(meta)
        raise
    os.close(top)
    left = _finish(meta, journal)
    if os.path.exists(jpath):
        os.unlink(jpath)
    return [rel for _, rel in writes], left


def _finish(meta: dict[str, Any], journal: dict[str, Any]) -> list[str]:
    """After a committed apply: remove the originals set aside. What cannot be removed is named."""
    left = []
    top = os.open(meta["project"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel, aside, *_ in journal["ops"]:
            if not aside:
                continue
            where = os.path.join(os.path.dirname(rel), aside)
            try:
                dfd = _dir_fd(top, os.path.dirname(rel), False, None, "")
                try:
                    _remove_at(aside, dfd)
                finally:
                    os.close(dfd)
            except (OSError, WorkspaceError):
                left.append(where)
    finally:
        os.close(top)
    return left


def _lstat_at(name: str, dfd: int) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=dfd)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _dir_fd(top: int, rel: str, create: bool, journal: dict[str, Any] | None, jpath: str) -> int:
    """The directory ``rel`` below ``top``, opened component by component without following a link;
    missing ones made (and journaled) when ``create``."""
    fd = os.dup(top)
    done = ""
    try:
        for part in [p for p in rel.split("/") if p]:
            done = f"{done}/{part}" if done else part
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if not create or journal is None:
                    raise
                journal["dirs"].append(done)
                _write_journal(jpath, journal)
                os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except NotADirectoryError:
                raise WorkspaceError("apply", f"{done} is not a directory in the project (a link or a file); "
                                     "nothing was written", "") from None
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _copy_in(src: str, name: str, dfd: int) -> None:
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), name, dir_fd=dfd)
        return
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            while chunk := os.read(sfd, 1 << 20):
                os.write(fd, chunk)
        finally:
            os.close(sfd)
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o775)  # no setuid/setgid, nor write for others, from the agent
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_at(name: str, dfd: int) -> None:
    st = _lstat_at(name, dfd)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        pfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:  # a read-only directory (go's module cache is 0555) is the owner's to open up first
            if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
                os.chmod(f"/proc/self/fd/{pfd}", stat.S_IMODE(st.st_mode) | 0o700)
            sub = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        finally:
            os.close(pfd)
        try:
            for n in os.listdir(sub):
                _remove_at(n, sub)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def _write_journal(path: str, journal: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(journal, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def roll_back(meta: dict[str, Any]) -> None:
    """Undo an apply cut short (by an error, or a crash: its journal is still there). As the owner."""
    jpath = os.path.join(_cs(meta), JOURNAL)
    try:
        with open(jpath) as f:
            journal = json.load(f)
    except FileNotFoundError:
        return
    if journal.get("committed"):  # everything had landed: only the originals' removal was cut short
        _finish(meta, journal)
        os.unlink(jpath)
        return
    top = os.open(meta["project"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel, aside, written, ino in reversed(journal["ops"]):
            try:
                dfd = _dir_fd(top, os.path.dirname(rel), False, None, "")
            except (FileNotFoundError, WorkspaceError):
                continue
            try:
                name = os.path.basename(rel)
                now = _lstat_at(name, dfd)
                if now is not None and (not written or now.st_ino != ino):
                    continue  # not what this apply wrote (the human's, made since a crash): left as it is
                if now is not None:
                    _remove_at(name, dfd)
                if aside and _lstat_at(aside, dfd) is not None:
                    os.rename(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            finally:
                os.close(dfd)
        for rel in reversed(journal["dirs"]):
            try:
                os.rmdir(rel, dir_fd=top)
            except OSError:
                pass
    finally:
        os.close(top)
    os.unlink(jpath)


def discard(session: str) -> None:
    with _locked():
        meta = load(session)
        as_owner(meta, roll_back, meta)
    from ..caches import _remove

    _record(meta, "session.discard", state=meta["state"])
    _remove(meta["dir"])
