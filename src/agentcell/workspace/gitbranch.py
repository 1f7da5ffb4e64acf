"""Git, run safely: as the human in their repository (no hook, no system config), or on a repository
of our own whose objects are the change set's and the project's. The agent's commits are read through
the latter and land as the branch ``agentcell/<session>``; a ``.git`` that is not the agent's own gives
none."""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from typing import Any

from .. import hostfs
from .store import WorkspaceError, _cs, _upper
from .tree import _is_whiteout, _lstat, _walk

GIT_SAFE = ["-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "core.untrackedCache=false",
            "-c", "core.commitGraph=false", "-c", "core.multiPackIndex=false"]
# In an agent's .git: what would make git read objects or config from elsewhere.
BORROWED = ("objects/info/alternates", "objects/info/http-alternates", "commondir", "config.worktree")


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


def _commit_files(meta: dict[str, Any], sha: str) -> list[str]:
    out = _ours_git(_objects_repo(meta), "diff-tree", "--no-commit-id", "-r", "-z", "--name-only", "--root", sha)
    return [os.fsdecode(p) for p in out.split(b"\0") if p]


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
