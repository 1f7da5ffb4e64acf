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
costs the same for any number of files: nothing is copied or scanned but git's list of ignored paths.

**The base.** A session starts from the project as it is at ``base_ns`` (the kernel's coarse clock, the
one file times are taken from) and, for git, from the commit HEAD names then. No content is copied: the
names of its files are listed (``base.names``: what the base held, so a file the human deleted since is
told from one the agent made), and a file whose change time (ctime, which no one but root can set back)
is before ``base_ns`` is still the base; one changed since is the human's change. ``apply`` is a three-way merge by file: what only the agent
changed lands; what only the human changed stays; what both changed is a conflict, refused and named
(unless both made it the same), nothing written. ``--ours PATH`` keeps the human's, ``--theirs PATH``
takes the agent's.

**Git.** The agent's commits come as a branch, ``agentcell/<session>``, packed from the change set and
indexed into the human's repository by git's plumbing run as the human (no hook, no configuration of the
agent's runs); what the agent left uncommitted lands in the tree as above. Nothing of the agent's
``.git`` (its config, hooks, index) is copied.

**Nothing is lost until discard.** The change set is on disk from the start: a supervisor killed
mid-session, or a reboot, leaves it reviewable and applicable; ``recover`` never removes one; only
``discard`` does.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from . import hostfs
from .cell.spec import Workspace
from .errors import AgentcellError

META = "meta.json"
BASE_NAMES = "base.names"  # every file's name at the start (NUL-separated): what the base held
JOURNAL = "apply.json"
WHITEOUT = os.makedev(0, 0)
CLOCK_REALTIME_COARSE = 5  # <linux/time.h>; not in Python's time module
OWNER_VIEW = "/run/agentcell-ws"  # where review and apply, run as the owner, see the change set (as_owner)
GIT_SAFE = ["-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "core.untrackedCache=false"]


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
        _whiteout(hide, rel)
    _write_names(os.path.join(d, BASE_NAMES), _listing(project, set(hidden)))
    meta = {"session": session, "project": project, "owner": list(owner), "account": list(account),
            "base_ns": base, "git": git, "hidden": hidden, "include": include, "userxattr": rootless,
            "state": "open", "trail": trail, "created": time.time()}
    meta["dir"] = d
    _save(meta)
    return Workspace(project, upper, work, hide if hidden else "", idmap, rootless)


def _listing(project: str, hidden: set[str]) -> list[str]:
    """The name of every non-directory in the project (not .git, not what the view hides): what the
    base held. Names only, from the directories (no stat of a file): 20,000 files in about 12 ms."""
    out: list[str] = []
    stack = [""]
    while stack:
        r = stack.pop()
        try:
            it = os.scandir(os.path.join(project, r) if r else project)
        except OSError:
            continue
        with it:
            for e in it:
                rel = f"{r}/{e.name}" if r else e.name
                if rel in hidden or (not r and e.name == ".git"):
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append(rel)
                else:
                    out.append(rel)
    return out


def _write_names(path: str, names: list[str]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(b"\0".join(os.fsencode(n) for n in names))


def _base_names(meta: dict[str, Any]) -> set[str]:
    if "base_names" in meta:  # (read by agentcell for the owner: see as_owner)
        return set(meta["base_names"])
    try:
        with open(os.path.join(meta["dir"], BASE_NAMES), "rb") as f:
            return {os.fsdecode(n) for n in f.read().split(b"\0") if n}
    except FileNotFoundError:
        return set()


def _rel(project: str, path: str) -> str:
    return os.path.relpath(path, project)


def _whiteout(top: str, rel: str) -> None:
    parent = os.path.join(top, os.path.dirname(rel))
    os.makedirs(parent, 0o755, exist_ok=True)
    os.mknod(os.path.join(top, rel), stat.S_IFCHR | 0o000, WHITEOUT)


def _as_owner(owner: tuple[int, int]) -> list[str]:
    """A command run as the project's owner (git reads and writes the human's repository as them)."""
    if os.geteuid() != 0 or owner[0] == 0:
        return []
    return ["setpriv", f"--reuid={owner[0]}", f"--regid={owner[1]}", "--clear-groups", "--"]


def _git(project: str, owner: tuple[int, int], *args: str, input: bytes | None = None) -> bytes:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C", "GIT_OPTIONAL_LOCKS": "0", "GIT_CONFIG_NOSYSTEM": "1",
           "HOME": "/nonexistent", "GIT_TERMINAL_PROMPT": "0"}
    p = subprocess.run([*_as_owner(owner), "git", *GIT_SAFE, "-c", f"safe.directory={project}", "-C", project,
                        *args], capture_output=True, input=input, env=env, timeout=600)
    if p.returncode != 0:
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
    """What overlayfs marked in the change set: directories it made opaque (the agent removed the
    project's and made its own) and entries it copied up from the project (origin: the same file, or
    one the agent renamed), as paths. Read by agentcell itself: as root they are trusted.* xattrs,
    which the owner cannot read (review and apply run as them); rootless, the user's own user.* ones."""
    prefix = "user.overlay." if meta.get("userxattr") else "trusted.overlay."
    out: dict[str, list[str]] = {"opaque": [], "origin": []}
    stack = [""]
    upper = _upper(meta)
    while stack:
        r = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(upper, r) if r else upper))
        except OSError:
            continue
        for e in entries:
            rel = f"{r}/{e.name}" if r else e.name
            try:
                names = os.listxattr(e.path, follow_symlinks=False)
            except OSError:
                names = []
            if prefix + "origin" in names:
                out["origin"].append(rel)
            if prefix + "opaque" in names and os.getxattr(e.path, prefix + "opaque", follow_symlinks=False) == b"y":
                out["opaque"].append(rel)
            if e.is_dir(follow_symlinks=False):
                stack.append(rel)
    return out


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == WHITEOUT


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _walk_files(top: str, rel: str = "") -> Iterator[str]:
    """Every non-directory below ``top/rel`` (relative names), iteratively, never following a link."""
    stack = [rel]
    while stack:
        r = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(top, r) if r else top))
        except OSError:
            continue
        for e in entries:
            sub = f"{r}/{e.name}" if r else e.name
            if e.is_dir(follow_symlinks=False):
                stack.append(sub)
            else:
                yield sub


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
    """What the agent changed, outside ``.git``: one entry per path, {"path", "change" (added | modified |
    deleted | renamed | mode | type), "from" (renamed), "human_changed" (the project's path is not the
    base any more), "same" (the human's is what the agent's is)}."""
    upper, project, base_ns = _upper(meta), meta["project"], int(meta["base_ns"])
    hidden = set(meta.get("hidden") or [])
    git = meta.get("git") is not None
    base_files = _base_names(meta)
    opaque = set((meta.get("marks") or marks(meta))["opaque"])
    out: list[dict[str, Any]] = []
    deleted: list[str] = []
    stack = [""]
    while stack:
        r = stack.pop()
        here = os.path.join(upper, r) if r else upper
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for e in entries:
            rel = f"{r}/{e.name}" if r else e.name
            if git and rel == ".git":
                continue
            st = e.stat(follow_symlinks=False)
            low = os.path.join(project, rel)
            lst = None if _under_hidden(rel, hidden) else _lstat(low)
            if _is_whiteout(st):
                if lst is not None:
                    deleted += [rel] if not stat.S_ISDIR(lst.st_mode) else \
                        [f"{rel}/{f}" for f in _walk_files(project, rel)]
                continue
            if stat.S_ISDIR(st.st_mode):
                if lst is not None and stat.S_ISDIR(lst.st_mode) and rel in opaque:
                    gone = {f for f in _walk_files(project, rel)} - {f for f in _walk_files(upper, rel)}
                    deleted += sorted(gone)
                elif lst is not None and not stat.S_ISDIR(lst.st_mode):
                    out.append(_entry(rel, "type", lst, base_ns, low, None))
                stack.append(rel)
                continue
            if _kind(st) == "other":  # a fifo, a socket, a device: shown, never applied
                out.append({"path": rel, "change": "added" if lst is None else "type", "human_changed": False,
                            "same": False, "special": True})
            elif lst is None and rel in base_files:
                # It was in the project when the agent took it up, and is not now: the human deleted it.
                out.append({"path": rel, "change": "modified", "human_changed": True, "same": False})
            elif lst is None:
                out.append(_entry(rel, "added", _lstat(low), base_ns, low, (e.path, st)))
            elif stat.S_ISDIR(lst.st_mode) or _kind(lst) != _kind(st):
                out.append(_entry(rel, "type", lst, base_ns, low, (e.path, st)))
            else:
                same = _digest(e.path, st) == _digest(low, lst)
                if same and stat.S_IMODE(st.st_mode) == stat.S_IMODE(lst.st_mode):
                    continue  # copied up, not changed (opened for writing, touched)
                out.append(_entry(rel, "mode" if same else "modified", lst, base_ns, low, (e.path, st)))
    for rel in deleted:
        lst = _lstat(os.path.join(project, rel))
        out.append({"path": rel, "change": "deleted", "human_changed": lst is not None and lst.st_ctime_ns >= base_ns,
                    "same": lst is None})
    _pair_renames(out, meta)
    return sorted(out, key=lambda c: c["path"])


def _under_hidden(rel: str, hidden: set[str]) -> bool:
    return any(rel == h or rel.startswith(h + "/") for h in hidden)


def _entry(rel: str, change: str, lst: os.stat_result | None, base_ns: int, low: str,
           agent: tuple[str, os.stat_result] | None) -> dict[str, Any]:
    """One change, and whether the human changed the same path since the base (then it is theirs too)."""
    # Added: the base had nothing the agent could see there, so anything there now is the human's.
    human = lst is not None if change == "added" else lst is None or lst.st_ctime_ns >= base_ns
    same = False
    if human and agent is not None and lst is not None and _kind(lst) == _kind(agent[1]):
        same = (_digest(agent[0], agent[1]) == _digest(low, lst)
                and stat.S_IMODE(agent[1].st_mode) == stat.S_IMODE(lst.st_mode))
    return {"path": rel, "change": change, "human_changed": human, "same": same}


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
                c["change"], c["from"] = "renamed", was["path"]
                c["human_changed"] = c["human_changed"] or was["human_changed"]
                out.remove(was)


# ---- git: the agent's commits -------------------------------------------------------------------------

def agent_head(meta: dict[str, Any]) -> str | None:
    """The commit the agent's HEAD names at the end (its ``.git`` as the view shows it: the change set
    over the project's), or None where it made none."""
    if meta.get("git") is None:
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


def commits(meta: dict[str, Any]) -> list[dict[str, str]]:
    head = agent_head(meta)
    if head is None:
        return []
    repo = _objects_repo(meta)
    base = meta["git"].get("head")
    rng = [head, f"^{base}"] if base else [head]
    out = _ours_git(repo, "log", "--format=%H%x00%an <%ae>%x00%s", *rng, "--")
    res = []
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
    head = agent_head(meta)
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
        if diffs and c["change"] in ("modified", "added", "renamed") and not c.get("special"):
            c["diff"] = _diff_text(meta, c["path"], c.get("from"))
    return {"session": meta["session"], "project": meta["project"], "state": meta["state"],
            "base": {"time_ns": meta["base_ns"], "commit": (meta.get("git") or {}).get("head")},
            "branch": f"agentcell/{meta['session']}" if head else None, "head": head, "commits": commits(meta),
            "changes": found, "hidden": meta.get("hidden", [])}


def record_review(r: dict[str, Any]) -> None:
    """The audit trail's record of a review: what the human was shown."""
    meta = load(r["session"])
    _record(meta, "session.review", state=r["state"], changes=len(r["changes"]), commits=len(r["commits"]),
            conflicts=[c["path"] for c in r["changes"] if c["conflict"]], base=r["base"])


def _diff_text(meta: dict[str, Any], rel: str, was: str | None = None) -> str:
    """A unified diff of one changed path: the project's (``was``: the renamed path's) against the agent's."""
    a, b = os.path.join(meta["project"], was or rel), os.path.join(_upper(meta), rel)
    p = subprocess.run(["diff", "-u", "--label", f"a/{was or rel}", "--label", f"b/{rel}",
                        a if os.path.isfile(a) and not os.path.islink(a) else "/dev/null",
                        b if os.path.isfile(b) and not os.path.islink(b) else "/dev/null"],
                       capture_output=True, timeout=60)
    return p.stdout.decode(errors="replace")


# ---- apply ----------------------------------------------------------------------------------------------

def apply(session: str, ours: tuple[str, ...] | list[str] = (), theirs: tuple[str, ...] | list[str] = ()
          ) -> dict[str, Any]:
    """Land the change set in the project as it is now: all of it or nothing. Returns what landed."""
    meta = load(session)
    if meta["state"] != "open":
        raise WorkspaceError("SESSION", f"session {session}'s workspace is {meta['state']}",
                             "'agentcell session review' shows what it held")
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
    todo = [c for c in r["changes"] if not c["committed"] and c["path"] not in ours_s and not c["same"]]
    conflicts = [c["path"] for c in todo if c["conflict"] and c["path"] not in theirs_s]
    if conflicts:
        raise WorkspaceError("apply", f"{len(conflicts)} path(s) changed in the project since the session began, "
                             f"and by the agent too: {', '.join(conflicts[:10])}{' …' if len(conflicts) > 10 else ''};"
                             " nothing was written",
                             "keep yours with --ours PATH or take the agent's with --theirs PATH, per path")
    landed = _land(meta, todo)
    branch = _fetch_branch(meta, r["head"]) if r["head"] else None
    return {"landed": landed, "branch": branch, "head": r["head"], "base": r["base"]}


def _land(meta: dict[str, Any], todo: list[dict[str, Any]]) -> list[str]:
    """Write the agent's version of each path into the project, behind a journal: each original is
    renamed aside next to itself first, so a failure (or a crash: the next apply or discard rolls
    back) leaves the project as it was. Every directory is walked by descriptor, never through a link."""
    upper = _upper(meta)
    writes: list[tuple[str, str]] = []
    for c in todo:
        if c["change"] == "renamed":
            writes += [("delete", c["from"]), ("write", c["path"])]
        elif c["change"] == "deleted":
            writes.append(("delete", c["path"]))
        else:
            writes.append(("write", c["path"]))
    journal: dict[str, Any] = {"ops": [], "dirs": []}
    jpath = os.path.join(_cs(meta), JOURNAL)
    top = os.open(meta["project"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for i, (what, rel) in enumerate(writes):
            dfd = _dir_fd(top, os.path.dirname(rel), what == "write", journal, jpath)
            try:
                name, aside = os.path.basename(rel), f".agentcell-aside-{meta['session']}-{i}"
                exists = _lstat_at(name, dfd) is not None
                journal["ops"].append([rel, aside if exists else "", what == "write"])
                _write_journal(jpath, journal)
                if exists:
                    os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
                if what == "write":
                    _copy_in(os.path.join(upper, rel), name, dfd)
            finally:
                os.close(dfd)
        for rel, aside, _ in journal["ops"]:  # all landed: the originals go
            if aside:
                dfd = _dir_fd(top, os.path.dirname(rel), False, None, "")
                try:
                    _remove_at(aside, dfd)
                finally:
                    os.close(dfd)
        if os.path.exists(jpath):
            os.unlink(jpath)
    except BaseException:
        roll_back(meta)
        raise
    finally:
        os.close(top)
    return [rel for _, rel in writes]


def _lstat_at(name: str, dfd: int) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=dfd)
    except FileNotFoundError:
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
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)  # no setuid/setgid from the agent
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_at(name: str, dfd: int) -> None:
    st = _lstat_at(name, dfd)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
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
    top = os.open(meta["project"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel, aside, written in reversed(journal["ops"]):
            try:
                dfd = _dir_fd(top, os.path.dirname(rel), False, None, "")
            except FileNotFoundError:
                continue
            try:
                name = os.path.basename(rel)
                if aside and _lstat_at(aside, dfd) is not None:
                    if _lstat_at(name, dfd) is not None:
                        _remove_at(name, dfd)
                    os.rename(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                elif written and not aside:
                    _remove_at(name, dfd)
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
    _git(meta["project"], owner, "index-pack", "--stdin", "--fix-thin", input=pack)
    branch = f"agentcell/{meta['session']}"
    _git(meta["project"], owner, "update-ref", f"refs/heads/{branch}", head, "")
    return branch


# ---- as the owner ---------------------------------------------------------------------------------------

def as_owner(meta: dict[str, Any], fn: Any, *args: Any) -> Any:
    """``fn(*args)`` as the project's owner: in a child that root forks and drops to the owner (no
    supplementary group), its result (JSON) or its error handed back. Run directly when we are them."""
    uid, gid = int(meta["owner"][0]), int(meta["owner"][1])
    if os.geteuid() != 0 or uid == 0:
        return fn(*args)
    meta["marks"] = marks(meta)  # (trusted.* xattrs: root reads them for the owner)
    meta["base_names"] = sorted(_base_names(meta))  # (in agentcell's directory, which the owner cannot enter)
    _made_dir(OWNER_VIEW, 0o755)
    cs = _cs(meta)  # (in agentcell's own directory: its name cannot be swapped by the owner)
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            # The state directory above the change set need not be the owner's to enter (and git
            # resolves every path to its real one): in a mount namespace of the child's own, the
            # change set is bound at OWNER_VIEW, which anyone may enter; nowhere else sees it.
            from .cell import syscalls as sc

            try:
                sc.unshare(sc.CLONE_NEWNS)
                sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
                sc.mount(cs, OWNER_VIEW, None, sc.MS_BIND)
                meta["cs"] = OWNER_VIEW
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
