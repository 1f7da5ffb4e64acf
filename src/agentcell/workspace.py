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
"""
from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import os
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import hostfs
from .cell.spec import Workspace
from .errors import AgentcellError

META = "meta.json"
BASE_NAMES = "base.names"  # every file's inode and name at the start (NUL-separated): what the base held
JOURNAL = "apply.json"
WHITEOUT = os.makedev(0, 0)
CLOCK_REALTIME_COARSE = 5  # <linux/time.h>; not in Python's time module
VIEW_OVER = ("/run", "/mnt", "/media", "/srv")  # (as_owner: where the owner's view of the change set goes)
GIT_SAFE = ["-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "core.untrackedCache=false",
            "-c", "core.commitGraph=false", "-c", "core.multiPackIndex=false"]
# In an agent's .git: what would make git read objects or config from elsewhere.
BORROWED = ("objects/info/alternates", "objects/info/http-alternates", "commondir", "config.worktree")


class WorkspaceError(AgentcellError):
    pass


def store() -> str:
    return os.path.join(hostfs.state_dir(), "workspaces")


def path_of(session: str) -> str:
    if not session or "/" in session or session.startswith("."):
        raise WorkspaceError("SESSION", f"{session!r} is not a session id", "'agentcell session list' names them")
    return os.path.join(store(), session)


def _cs(meta: dict[str, Any]) -> str:
    """The change set's directory (as the owner: where root bound it for them, see :func:`as_owner`)."""
    return str(meta.get("cs") or os.path.join(meta["dir"], "cs"))


def _upper(meta: dict[str, Any]) -> str:
    return os.path.join(_cs(meta), "upper")


def _made_dir(path: str, mode: int) -> None:
    """``path``, a directory of ours with ``mode``: made, or found as a real directory of ours."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise WorkspaceError("workspace", f"{hostfs.shown(path)} is not a directory of agentcell's",
                             "remove it (it was not made by agentcell)")
    os.chmod(path, mode)


def load(session: str) -> dict[str, Any]:
    d = path_of(session)
    try:
        with open(os.path.join(d, META)) as f:
            meta: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise WorkspaceError("SESSION", f"session {session} has no workspace (it ran in the project itself, or "
                             "it was discarded)", "'agentcell session list --unapplied' names those that "
                             "wait") from None
    meta["dir"] = d
    return meta


def _save(meta: dict[str, Any]) -> None:
    d = meta["dir"]
    tmp = os.path.join(d, META + ".tmp")
    with open(tmp, "w") as f:
        json.dump({k: v for k, v in meta.items() if k != "dir"}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, META))


def base_now() -> int:
    """The base's time: the coarse clock file times come from (a write after this has a ctime at or
    after it; one at the same tick counts as after: a false conflict, never a missed one)."""
    return time.clock_gettime_ns(CLOCK_REALTIME_COARSE)


# ---- create -------------------------------------------------------------------------------------------

def create(session: str, project: str, *, owner: tuple[int, int], account: tuple[int, int],
           include: list[str], masked: list[str], trail: str | None) -> Workspace:
    """The session's workspace: its store entry, and the layers for the cell (a
    :class:`~agentcell.cell.spec.Workspace`)."""
    base = base_now()
    os.makedirs(os.path.dirname(store()), 0o700, exist_ok=True)
    _made_dir(store(), 0o711)
    d = path_of(session)
    project = os.path.realpath(project)
    rootless = os.geteuid() != 0
    idmap = () if rootless or (owner[0], owner[1]) == (account[0], account[1]) else (*owner, *account)
    cs = os.path.join(d, "cs")
    upper, work, hide = (os.path.join(cs, n) for n in ("upper", "work", "hide"))
    if os.path.exists(os.path.join(d, META)):  # a retried spawn: the same workspace, whatever it holds already
        meta = load(session)
        return Workspace(project, upper, work, hide if meta["hidden"] else "", idmap, rootless)
    os.mkdir(d, 0o711)
    os.mkdir(cs, 0o700)
    st = os.stat(project)
    os.mkdir(upper, stat.S_IMODE(st.st_mode))
    os.mkdir(work, 0o700)
    os.mkdir(hide, 0o755)
    if not rootless:
        os.chown(cs, owner[0], owner[1])  # the change set is the owner's to review (upper: see give_back)
        os.chown(upper, account[0], account[1])  # the view's root is upper's: the account's, as the project is shown
    git = _git_base(project, owner)
    hidden = sorted(set(_ignored(project, owner, include) if git else []) | {_rel(project, m) for m in masked})
    for rel in hidden:
        _whiteout(hide, rel, project, None if rootless else account)
    _write_names(os.path.join(d, BASE_NAMES), _listing(project, set(hidden)))
    meta = {"session": session, "project": project, "owner": list(owner), "account": list(account),
            "base_ns": base, "git": git, "hidden": hidden, "include": include, "userxattr": rootless,
            "state": "open", "trail": trail, "created": time.time()}
    meta["dir"] = d
    _save(meta)
    return Workspace(project, upper, work, hide if hidden else "", idmap, rootless)


def _listing(project: str, hidden: set[str]) -> dict[str, int]:
    """Every non-directory in the project (not .git, not what the view hides, not past a mount) and its
    inode number: what the base held. From the directories alone (readdir gives the inode; no file is
    stat'ed): 20,000 files in about 12 ms. A file replaced since (a rename over it, a directory moved
    in its place) has another inode."""
    return {rel: e.inode() for rel, e in _walk(project, skip=lambda rel, e: rel in hidden or rel == ".git")
            if not e.is_dir(follow_symlinks=False)}


def _write_names(path: str, names: dict[str, int]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(b"\0".join(b"%d\0%s" % (ino, os.fsencode(n)) for n, ino in names.items()))


def _base_names(meta: dict[str, Any]) -> dict[str, int]:
    """What the base held: path -> inode number."""
    if "base_names" in meta:  # (read by agentcell for the owner: see as_owner)
        return dict(meta["base_names"])
    try:
        with open(os.path.join(meta["dir"], BASE_NAMES), "rb") as f:
            parts = f.read().split(b"\0")
    except FileNotFoundError:
        return {}
    return {os.fsdecode(parts[i + 1]): int(parts[i]) for i in range(0, len(parts) - 1, 2)}


def _rel(project: str, path: str) -> str:
    return os.path.relpath(path, project)


def _whiteout(top: str, rel: str, project: str, account: tuple[int, int] | None) -> None:
    """A whiteout at ``rel`` in the hide layer. Its directories are what the view shows for the project's
    (the topmost layer that has a directory gives its owner and mode): the project's mode, the account's
    as the idmapped project shows them, so the agent can still write in a directory that holds a hidden
    entry."""
    cur = top
    for part in [p for p in os.path.dirname(rel).split("/") if p]:
        cur = os.path.join(cur, part)
        if not os.path.isdir(cur):
            there = os.lstat(os.path.join(project, os.path.relpath(cur, top)))
            os.mkdir(cur, 0o700)
            if account is not None:
                os.chown(cur, account[0], account[1])
            os.chmod(cur, stat.S_IMODE(there.st_mode) & 0o7777)
    os.mknod(os.path.join(top, rel), stat.S_IFCHR | 0o000, WHITEOUT)


def _as_owner(owner: tuple[int, int]) -> list[str]:
    """A command run as the project's owner (git reads and writes the human's repository as them)."""
    if os.geteuid() != 0 or owner[0] == 0:
        return []
    return ["setpriv", f"--reuid={owner[0]}", f"--regid={owner[1]}", "--clear-groups", "--"]


def _git(project: str, owner: tuple[int, int], *args: str, input: bytes | None = None,
         ok: tuple[int, ...] = (0,)) -> bytes:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C", "GIT_OPTIONAL_LOCKS": "0", "GIT_CONFIG_NOSYSTEM": "1",
           "HOME": "/nonexistent", "GIT_TERMINAL_PROMPT": "0"}
    p = subprocess.run([*_as_owner(owner), "git", *GIT_SAFE, "-c", f"safe.directory={project}", "-C", project,
                        *args], capture_output=True, input=input, env=env, timeout=600)
    if p.returncode not in ok:
        raise WorkspaceError("git", f"git {args[0]} in {hostfs.shown(project)} failed: "
                             f"{p.stderr.decode(errors='replace').strip()[-300:]}", "")
    return p.stdout


def _git_base(project: str, owner: tuple[int, int]) -> dict[str, Any] | None:
    """The commit the session starts from (HEAD, as the human's git names it), or None: no repository."""
    if not os.path.isdir(os.path.join(project, ".git")):
        return None
    try:
        head = _git(project, owner, "rev-parse", "--verify", "-q", "HEAD").decode().strip()
    except WorkspaceError:
        head = ""  # a repository without a commit yet
    fmt = _git(project, owner, "rev-parse", "--show-object-format").decode().strip() or "sha1"
    return {"head": head, "object_format": fmt}


def _ignored(project: str, owner: tuple[int, int], include: list[str]) -> list[str]:
    """What git ignores in the project (a directory as one entry), less what ``include`` names."""
    out = _git(project, owner, "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory")
    wanted = [i.strip("/") for i in include]
    paths = []
    for raw in out.split(b"\0"):
        if not raw:
            continue
        rel = os.fsdecode(raw).rstrip("/")
        if rel == ".git" or rel.startswith(".git/"):
            continue
        if any(rel == w or w.startswith(rel + "/") or rel.startswith(w + "/") for w in wanted):
            if any(w.startswith(rel + "/") for w in wanted):  # a directory holding an included file: its rest stays
                paths += _ignored_inside(project, rel, wanted)
            continue
        paths.append(rel)
    return paths


def _ignored_inside(project: str, rel: str, wanted: list[str]) -> list[str]:
    """Entries of an ignored directory that hold no included path (so those stay hidden)."""
    out = []
    try:
        names = os.listdir(os.path.join(project, rel))
    except OSError:
        return []
    for n in names:
        sub = f"{rel}/{n}"
        if any(sub == w or sub.startswith(w + "/") for w in wanted):
            continue
        if any(w.startswith(sub + "/") for w in wanted):
            out += _ignored_inside(project, sub, wanted)
        else:
            out.append(sub)
    return out


# ---- the change set -----------------------------------------------------------------------------------

def marks(meta: dict[str, Any]) -> dict[str, list[str]]:
    """The directories overlayfs made opaque in the change set (the agent removed the project's and made
    its own), as paths. Read by agentcell itself: as root the mark is a trusted.* xattr, which the owner
    cannot read (review and apply run as them); rootless, the user's own user.* one. Walked by
    descriptor, never through a link (the change set is the owner's to rearrange)."""
    name = ("user." if meta.get("userxattr") else "trusted.") + "overlay.opaque"
    out: dict[str, list[str]] = {"opaque": []}
    try:
        top = os.open(_upper(meta), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return out
    stack: list[tuple[int, str]] = [(top, "")]
    while stack:
        fd, r = stack.pop()
        try:
            for e in os.scandir(fd):
                if not e.is_dir(follow_symlinks=False):
                    continue
                try:
                    sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError:
                    continue
                rel = f"{r}/{e.name}" if r else e.name
                try:
                    if os.getxattr(sub, name) == b"y":
                        out["opaque"].append(rel)
                except OSError:
                    pass
                stack.append((sub, rel))
        finally:
            os.close(fd)
    return out


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == WHITEOUT


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _walk(top: str, start: str = "", skip: Callable[[str, os.DirEntry[str]], bool] | None = None,
          strict: bool = False) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every entry below ``top/start``: (its path relative to ``top``, its entry), iteratively, never
    following a link nor entering a directory on another file system (the view does not cross mounts
    either). ``skip``: entries left out, and not entered. A directory that cannot be read is passed
    over, or with ``strict`` its error raised."""
    try:
        dev = os.lstat(top).st_dev
    except OSError:
        if strict:
            raise
        return
    stack = [start]
    while stack:
        r = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(top, r) if r else top))
        except OSError:
            if strict:
                raise
            continue
        for e in entries:
            rel = f"{r}/{e.name}" if r else e.name
            if skip is not None and skip(rel, e):
                continue
            yield rel, e
            if e.is_dir(follow_symlinks=False) and e.stat(follow_symlinks=False).st_dev == dev:
                stack.append(rel)


def _walk_files(top: str, rel: str = "") -> Iterator[str]:
    """Every non-directory below ``top/rel`` (paths relative to ``top``)."""
    return (r for r, e in _walk(top, rel) if not e.is_dir(follow_symlinks=False))


def _digest(path: str, st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "link:" + os.readlink(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _kind(st: os.stat_result) -> str:
    return "symlink" if stat.S_ISLNK(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"


def changes(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """What the agent changed, outside a git project's own ``.git``: one entry per path, {"path",
    "change" (added | modified | deleted | renamed | mode | type), "from" (renamed), "human_changed" (the
    project's path is not what the base had: changed, replaced, deleted or made since), "same" (the
    human's is what the agent's is), "hidden" (the view left it out: never diffed against the
    project's), "removes" (a directory the agent replaced: the files that go with it), "link" (a
    symlink's target), "mode"}."""
    upper, project, base_ns = _upper(meta), meta["project"], int(meta["base_ns"])
    hidden = set(meta.get("hidden") or [])
    git = meta.get("git") is not None
    base = _base_names(meta)
    opaque = set((meta.get("marks") or marks(meta))["opaque"])

    def theirs(rel: str, lst: os.stat_result | None) -> bool:
        ino = base.get(rel)
        if ino is None:  # not in the base (or hidden from the view): anything there now is the human's
            return lst is not None
        return lst is None or lst.st_ino != ino or lst.st_ctime_ns >= base_ns

    ordered = sorted(base)

    def below(rel: str) -> list[str]:
        """The files under ``rel`` in the base and in the project now."""
        i = bisect.bisect_left(ordered, rel + "/")
        j = bisect.bisect_left(ordered, rel + "0")  # ("0" follows "/")
        return sorted(set(ordered[i:j]) | set(_walk_files(project, rel)))

    out: list[dict[str, Any]] = []
    deleted: list[str] = []
    for rel, e in _walk(upper, skip=lambda rel, e: git and rel == ".git"):
        st = e.stat(follow_symlinks=False)
        low = os.path.join(project, rel)
        lst = _lstat(low)
        if _is_whiteout(st):
            if lst is not None and stat.S_ISDIR(lst.st_mode):  # a directory, as one: it goes whole
                files = below(rel)
                out.append({"path": rel, "change": "deleted", "dir": True, "removes": files, "same": False,
                            "seen": _seen(lst),
                            "hidden": _under_hidden(rel, hidden),
                            "human_changed": any(theirs(f, _lstat(os.path.join(project, f))) for f in files)})
            else:
                deleted.append(rel)
            continue
        if stat.S_ISDIR(st.st_mode):
            if lst is not None and stat.S_ISDIR(lst.st_mode):
                if rel in opaque:  # the agent removed the directory and made its own
                    deleted += sorted(set(below(rel)) - set(_walk_files(upper, rel)))
            elif lst is not None or rel in base:  # a file the agent replaced by a directory
                deleted.append(rel)
            continue
        c: dict[str, Any] = {"path": rel, "hidden": _under_hidden(rel, hidden), "mode": stat.S_IMODE(st.st_mode),
                             "seen": _seen(lst)}
        if stat.S_ISLNK(st.st_mode):
            c["link"] = os.readlink(e.path)
        if _kind(st) == "other":  # a fifo, a socket, a device: shown, never applied
            c.update(change="added" if lst is None else "type", human_changed=False, same=False, special=True)
        elif lst is not None and stat.S_ISDIR(lst.st_mode):  # a directory the agent replaced by a file
            files = below(rel)
            c.update(change="type", removes=files, same=False,
                     human_changed=any(theirs(f, _lstat(os.path.join(project, f))) for f in files))
        elif lst is None:
            c.update(change="modified" if rel in base else "added", human_changed=rel in base, same=False)
        else:
            same = _kind(lst) == _kind(st) and _digest(e.path, st) == _digest(low, lst)
            if same and stat.S_IMODE(st.st_mode) == stat.S_IMODE(lst.st_mode) and not theirs(rel, lst):
                continue  # copied up, not changed (opened for writing, touched)
            change = "type" if _kind(lst) != _kind(st) else "mode" if same else "modified"
            c.update(change=change if rel in base else "added", human_changed=theirs(rel, lst),
                     same=same and stat.S_IMODE(st.st_mode) == stat.S_IMODE(lst.st_mode))
        out.append(c)
    for rel in dict.fromkeys(deleted):
        lst = _lstat(os.path.join(project, rel))
        if lst is None and rel not in base:
            continue
        out.append({"path": rel, "change": "deleted", "human_changed": theirs(rel, lst), "same": lst is None,
                    "hidden": _under_hidden(rel, hidden), "seen": _seen(lst)})
    # A directory the agent replaced by a file takes its files with it: no deletion of them on their own.
    covered = [c["path"] for c in out if c.get("removes") and not c.get("dir")]
    out = [c for c in out if not (c["change"] == "deleted" and any(hostfs.within(c["path"], p) and c["path"] != p
                                                                     for p in covered))]
    _pair_renames(out, meta)
    return sorted(out, key=lambda c: c["path"])


def _seen(lst: os.stat_result | None) -> list[int] | None:
    """What the project's entry was when the change set was read: apply lands only on that very one."""
    return None if lst is None else [lst.st_ino, lst.st_ctime_ns]


def _under_hidden(rel: str, hidden: set[str]) -> bool:
    return any(hostfs.within(rel, h) for h in hidden)


def _pair_renames(out: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """A deletion and an addition of the same content are a rename (reported so; applied as both)."""
    upper = _upper(meta)
    gone: dict[str, dict[str, Any]] = {}
    for c in out:
        if c["change"] == "deleted":
            p = os.path.join(meta["project"], c["path"])
            st = _lstat(p)
            if st is not None and stat.S_ISREG(st.st_mode):
                gone.setdefault(_digest(p, st), c)
    if not gone:
        return
    for c in out:
        if c["change"] == "added":
            p = os.path.join(upper, c["path"])
            st = os.lstat(p)
            d = _digest(p, st) if stat.S_ISREG(st.st_mode) else None
            if d in gone:
                was = gone.pop(d)
                c["change"], c["from"], c["from_seen"] = "renamed", was["path"], was.get("seen")
                c["human_changed"] = c["human_changed"] or was["human_changed"]
                out.remove(was)


# ---- git: the agent's commits -------------------------------------------------------------------------

def git_problem(meta: dict[str, Any]) -> str | None:
    """Why the agent's ``.git`` cannot be read for its commits, or None. Its objects must be its own and
    the project's: a ``.git`` replaced by a link or a file, a link anywhere in it, or a pointer to other
    object stores (alternates, commondir) would bring in a repository the agent could not see."""
    top = os.path.join(_upper(meta), ".git")
    st = _lstat(top)
    if st is None:
        return None
    if _is_whiteout(st):
        return "the agent removed the repository's .git"
    if not stat.S_ISDIR(st.st_mode):
        return "the agent replaced .git by a link or a file"
    if any(os.path.lexists(os.path.join(top, r)) for r in BORROWED):
        return "the agent's .git borrows objects or config from elsewhere (alternates, commondir)"
    try:
        for rel, e in _walk(top, strict=True):
            if e.is_symlink():
                return f"the agent's .git holds a link (.git/{rel})"
    except OSError as e:
        return f"{os.path.relpath(str(e.filename), _upper(meta))} cannot be read"
    return None


def agent_head(meta: dict[str, Any], problem: str | None) -> str | None:
    """The commit the agent's HEAD names at the end (its ``.git`` as the view shows it: the change set
    over the project's), or None where it made none or its ``.git`` cannot be trusted (``problem``:
    :func:`git_problem`'s answer)."""
    if meta.get("git") is None or problem is not None:
        return None
    ref = _read_view(meta, ".git/HEAD").strip()
    if ref.startswith("ref: "):
        name = ref[5:].strip()
        if not name.startswith("refs/") or ".." in name:
            return None
        sha = _read_view(meta, f".git/{name}").strip()
        if not sha:
            for line in _read_view(meta, ".git/packed-refs").splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == name:
                    sha = parts[0]
    else:
        sha = ref
    if not sha or not all(c in "0123456789abcdef" for c in sha) or sha == meta["git"].get("head"):
        return None
    try:  # a commit, not a tag or a tree that git's log would see through and its refs refuse
        if _ours_git(_objects_repo(meta), "cat-file", "-t", sha).strip() != b"commit":
            return None
    except WorkspaceError:
        return None
    return sha


def _read_view(meta: dict[str, Any], rel: str) -> str:
    """A small file as the agent's view has it: the change set's, unless it is not there (or a whiteout)."""
    for top in (_upper(meta), meta["project"]):
        p = os.path.join(top, rel)
        st = _lstat(p)
        if st is None:
            continue
        if _is_whiteout(st) or not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
            return ""
        with open(p, errors="replace") as f:
            return f.read()
    return ""


def _objects_repo(meta: dict[str, Any]) -> str:
    """A repository of our own whose objects are the change set's and the project's (alternates): the
    agent's commits are read through it, never through the agent's configuration."""
    d = os.path.join(_cs(meta), "objects.git")
    if not os.path.isdir(d):
        os.makedirs(os.path.join(d, "objects", "info"), 0o700)
        os.makedirs(os.path.join(d, "refs"), 0o700)
        with open(os.path.join(d, "HEAD"), "w") as f:
            f.write("ref: refs/heads/none\n")
        fmt = (meta.get("git") or {}).get("object_format", "sha1")
        with open(os.path.join(d, "config"), "w") as f:
            f.write("[core]\n\trepositoryformatversion = 1\n\tbare = true\n"
                    f"[extensions]\n\tobjectformat = {fmt}\n")
    with open(os.path.join(d, "objects", "info", "alternates"), "w") as f:
        f.write(os.path.join(_upper(meta), ".git", "objects") + "\n")
        f.write(os.path.join(meta["project"], ".git", "objects") + "\n")
    return d


def _ours_git(repo: str, *args: str, input: bytes | None = None) -> bytes:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"}
    p = subprocess.run(["git", *GIT_SAFE, "--git-dir", repo, *args], capture_output=True, env=env, timeout=600,
                       input=input)
    if p.returncode != 0:
        raise WorkspaceError("git", f"git {args[0]} on the change set failed: "
                             f"{p.stderr.decode(errors='replace').strip()[-300:]}", "")
    return p.stdout


def commits(meta: dict[str, Any], head: str | None) -> list[dict[str, Any]]:
    """The agent's commits from the base to ``head`` (:func:`agent_head`), newest first."""
    if head is None:
        return []
    repo = _objects_repo(meta)
    base = meta["git"].get("head")
    rng = [head, f"^{base}"] if base else [head]
    out = _ours_git(repo, "log", "--format=%H%x00%an <%ae>%x00%s", *rng, "--")
    res: list[dict[str, Any]] = []
    for line in out.decode(errors="replace").splitlines():
        sha, author, subject = (line.split("\0") + ["", ""])[:3]
        res.append({"commit": sha, "author": author, "subject": subject})
    return res


def _committed(meta: dict[str, Any], head: str | None) -> dict[str, str]:
    """path -> blob id in the agent's last commit (its tree), for telling committed work from the rest."""
    if head is None:
        return {}
    out = _ours_git(_objects_repo(meta), "ls-tree", "-r", "-z", head)
    res = {}
    for item in out.split(b"\0"):
        if not item:
            continue
        info, _, path = item.partition(b"\t")
        res[os.fsdecode(path)] = info.split()[2].decode()
    return res


def _blob_id(path: str, fmt: str) -> str:
    if stat.S_ISLNK(os.lstat(path).st_mode):
        data = os.fsencode(os.readlink(path))
    else:
        with open(path, "rb") as f:
            data = f.read()
    h = hashlib.sha256() if fmt == "sha256" else hashlib.sha1()
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


# ---- review -------------------------------------------------------------------------------------------

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


def control(project: str, rel: str, targets: tuple[str, ...] = (), repos: tuple[str, ...] = ()) -> str | None:
    """The entry of ``rel`` that decides what git, a shell or an agent runs, relative to the project, or
    None: a ``.git`` anywhere, hooks, ``.envrc``, harness and editor config
    (:func:`agentcell.protect.surface.protected_part`); a ``.gitattributes``, which can name filters; what the
    project's git config points git at for code (``targets``: core.hooksPath, include.path); a
    directory shaped like a bare repository (``repos``), whose config git would read there."""
    from .protect.surface import protected_part

    part = protected_part(os.path.join(project, rel), project)
    if part is not None:
        return os.path.relpath(part, project)
    for t in (*targets, *repos):
        if hostfs.within(rel, t):
            return t
    return rel if os.path.basename(rel) == ".gitattributes" else None


def _targets(meta: dict[str, Any]) -> tuple[str, ...]:
    """What the project's own git config (the human's) points git at for code, inside the project."""
    from .protect.surface import config_targets

    project = meta["project"]
    git_dir = os.path.join(project, ".git")
    if not os.path.isdir(git_dir):
        return ()
    return tuple(os.path.relpath(t, project) for t in config_targets(git_dir, project) if hostfs.within(t, project))


def _bare_in_view(meta: dict[str, Any], paths: list[str]) -> tuple[str, ...]:
    """The directories above ``paths`` that the agent's view shows shaped like a bare repository (a HEAD
    file, and an objects/ or refs/ directory, in the change set or in the project beneath it: a bare
    repository of the human's whose config the agent edited counts too). A layer's entry is enough:
    when unsure, the path is flagged."""
    def has(rel: str, is_dir: bool) -> bool:
        for top in (_upper(meta), meta["project"]):
            st = _lstat(os.path.join(top, rel))
            if st is not None and not _is_whiteout(st) and (stat.S_ISDIR(st.st_mode) if is_dir
                                                            else stat.S_ISREG(st.st_mode)):
                return True
        return False

    seen: dict[str, bool] = {}
    for p in paths:
        d = os.path.dirname(p)
        while d and d not in seen:
            seen[d] = has(f"{d}/HEAD", False) and (has(f"{d}/objects", True) or has(f"{d}/refs", True))
            d = os.path.dirname(d)
    return tuple(sorted(d for d, bare in seen.items() if bare))


def _bare_shaped(paths: list[str]) -> tuple[str, ...]:
    """Directories among ``paths``' parents that hold a HEAD and objects/ or refs/: git takes such a
    directory for a bare repository and reads its config."""
    heads = {os.path.dirname(p) for p in paths if os.path.basename(p) == "HEAD"}
    out = set()
    for d in heads:
        pre = f"{d}/" if d else ""
        if any(p.startswith(pre + "objects/") or p.startswith(pre + "refs/") for p in paths):
            out.add(d or ".")
    return tuple(sorted(out))


def _commit_files(meta: dict[str, Any], sha: str) -> list[str]:
    out = _ours_git(_objects_repo(meta), "diff-tree", "--no-commit-id", "-r", "-z", "--name-only", "--root", sha)
    return [os.fsdecode(p) for p in out.split(b"\0") if p]


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


# ---- apply ----------------------------------------------------------------------------------------------

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


def _fetch_branch(meta: dict[str, Any], head: str) -> str:
    """The agent's commits into the human's repository as ``agentcell/<session>``: a pack of what the
    base does not have, made from our own repository, indexed and named by the human's git (plumbing:
    no hook runs, and nothing of the agent's configuration is read)."""
    repo = _objects_repo(meta)
    base = meta["git"].get("head")
    pack = _ours_git(repo, "pack-objects", "--revs", "--stdout",
                     input=(f"{head}\n" + (f"^{base}\n" if base else "")).encode())
    owner = (os.geteuid(), os.getegid())
    _git(meta["project"], owner, "index-pack", "--strict", "--stdin", "--fix-thin", input=pack)
    branch = f"agentcell/{meta['session']}"
    _git(meta["project"], owner, "update-ref", f"refs/heads/{branch}", head, "")
    return branch


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One apply (or discard) at a time: two landing on one project at once would each check its
    conflicts against a tree the other is changing."""
    _made_dir(store(), 0o711)
    fd = os.open(os.path.join(store(), ".apply.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# ---- as the owner ---------------------------------------------------------------------------------------

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
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            # The state directory above the change set need not be the owner's to enter (and git
            # resolves every path to its real one): in a mount namespace of the child's own, a tmpfs
            # over a directory the project is not in (/run, say) holds the change set, bound there;
            # nothing outside the child sees either, and nothing is left on the host.
            from .cell import syscalls as sc

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


# ---- discard, list --------------------------------------------------------------------------------------

def discard(session: str) -> None:
    with _locked():
        meta = load(session)
        as_owner(meta, roll_back, meta)
    from .caches import _remove

    _record(meta, "session.discard", state=meta["state"])
    _remove(meta["dir"])


def listing(unapplied_only: bool = False) -> list[dict[str, Any]]:
    out = []
    try:
        names = sorted(os.listdir(store()))
    except FileNotFoundError:
        return []
    for n in names:
        try:
            meta = load(n)
        except (WorkspaceError, OSError, ValueError):
            continue
        if unapplied_only and meta["state"] != "open":
            continue
        out.append({"session": n, "project": meta["project"], "state": meta["state"], "created": meta["created"]})
    return out


def give_back(session: str, uid: int, gid: int) -> list[str]:
    """At the end of a session: what its account made in the change set becomes the project owner's
    (before an ephemeral account's number is freed), as it would be had the agent worked in the project
    itself. What could not be handed over."""
    from .accounts import acl
    from .accounts.commands import Commands

    meta = load(session)
    owner = (int(meta["owner"][0]), int(meta["owner"][1]))
    if (uid, gid) == owner:
        return []
    return acl.reassign(Commands(), uid, gid, owner[0], owner[1], _upper(meta))


def _record(meta: dict[str, Any], event: str, **details: Any) -> None:
    from .audit.trail import AuditLog

    AuditLog(meta.get("trail")).append(event, session=meta["session"], project=meta["project"], **details)
