"""Protected paths inside writable projects: what an agent could plant for a human to run later.

Git runs ``.git/hooks/*`` and what its config says (``core.fsmonitor``, ``core.hooksPath``, aliases)
when the human next uses the repository; harness config (``.claude/``, ``.mcp.json``, …) decides
what the human's next agent may do; ``.envrc`` and shell rc files run in the human's shell.

Two mechanisms, because the first cannot cover everything:

* **Read-only binds** (prevention) for every such entry that exists when the cell starts, at each
  writable root and in every repository found below it: hooks and config of every git directory
  (submodules' too, at any depth), ``.git`` files (submodule and worktree links), and the harness and
  shell names. Every ``.git`` directory, and each directory down to a nested repository, is bound
  onto itself so it cannot be renamed away and rebuilt. ``git add``/``commit`` keep working.
* **A before/after comparison** of the whole control surface — the entries above, the files through
  which git finds another config or hooks (``commondir``, ``config.worktree``, a worktree's
  ``commondir``/``gitdir``), and every ``.git`` entry. An entry that did not exist cannot be bound,
  so what the command *created* is **quarantined** after the run (:func:`quarantine`): renamed in
  place to ``NAME.agentcell-quarantine-<cell id>``, which no tool looks for, and reported. Nothing
  of the user's is touched: only entries absent before the run are moved, and their content is
  kept for review. What was changed or removed (``.git`` stays writable for git's own work) is
  reported; undoing it is the snapshot's job.

``core.hooksPath`` and ``include.path`` targets inside the writable paths (husky and the like) are
read from each config (by a small reader: git itself is never run on such a repository) and bound
read-only too.

Known limits: the scan stops at MAX_DEPTH levels and MAX_DIRS directories and skips dependency and
cache directories (a truncated scan is reported); only the names below are known.
"""
from __future__ import annotations

import os
import stat

from ..errors import LaunchError
from . import paths

QUARANTINE = ".agentcell-quarantine-"
GIT_PARTS = ("hooks", "config")
# Files through which git looks for config or hooks elsewhere: compared before and after a run.
GIT_REDIRECTS = ("commondir", "config.worktree", "info/attributes")
AT_REPO_ROOT = (
    ".gitmodules", ".claude", ".codex", ".cursor", ".vscode", ".idea", ".mcp.json", "opencode.json", ".envrc",
    ".bashrc", ".bash_profile", ".bash_login", ".profile", ".zshrc", ".zprofile", ".zshenv", ".zlogin",
    "AGENTS.md", "CLAUDE.md", "GEMINI.md", ".gemini", ".aider.conf.yml", ".npmrc", ".yarnrc.yml", ".cargo",
    ".devcontainer", ".cursorrules", ".windsurfrules", ".clinerules", "mise.toml", ".nvim.lua",
)
_NAMES = frozenset(AT_REPO_ROOT)
SKIP_DIRS = frozenset({"node_modules", ".venv", "venv", "__pycache__", ".tox", ".mypy_cache", ".pytest_cache",
                       ".ruff_cache", "target", ".cache", ".git"})
MAX_DEPTH = 8
MAX_DIRS = 5000  # a scan that far costs ~100 ms here (/usr/share); a run scans up to three times
MAX_MODULE_DEPTH = 8


class Scan:
    """Repositories below the writable roots, and whether the scan hit one of its limits."""

    def __init__(self, writable: tuple[str, ...]) -> None:
        self.roots = tuple(r for r in writable if os.path.isdir(r))
        self.truncated = False
        self.repos: list[str] = []
        self.named: list[str] = []  # harness or shell entries found at any depth (nested CLAUDE.md, …)
        for root in self.roots:
            self._walk(root)

    def _walk(self, root: str) -> None:
        level, seen = [root], 0
        for depth in range(MAX_DEPTH + 1):
            nxt: list[str] = []
            for d in level:
                try:
                    entries = list(os.scandir(d))
                except OSError:
                    continue
                if any(e.name == ".git" for e in entries):
                    self.repos.append(d)
                self.named += [e.path for e in entries if e.name in _NAMES]
                for e in entries:
                    if e.name in SKIP_DIRS or not e.is_dir(follow_symlinks=False):
                        continue
                    seen += 1
                    if seen > MAX_DIRS or depth == MAX_DEPTH:
                        self.truncated = True
                        if seen > MAX_DIRS:
                            return
                        continue
                    nxt.append(e.path)
            level = nxt


def _git_dirs(repo: str) -> list[str]:
    """The repository's own git directory and every submodule's under .git/modules, at any depth."""
    git = os.path.join(repo, ".git")
    if not os.path.isdir(git) or os.path.islink(git):
        return []
    found, level = [git], [os.path.join(git, "modules")]
    for _ in range(MAX_MODULE_DEPTH):
        nxt: list[str] = []
        for d in level:
            try:
                entries = [e for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for e in entries:
                if os.path.exists(os.path.join(e.path, "HEAD")):
                    found.append(e.path)
                    nxt.append(os.path.join(e.path, "modules"))
                else:
                    nxt.append(e.path)  # a submodule named a/b: its git dir is modules/a/b
        level = nxt
    return found


def _kind(path: str) -> int | None:
    try:
        return stat.S_IFMT(os.lstat(path).st_mode)
    except OSError:
        return None


def pinned_paths(scan: Scan) -> tuple[str, ...]:
    """Directories to bind onto themselves, writable, so that inside the cell they are mount points
    and cannot be renamed away and rebuilt: every ``.git`` directory, and every directory on the way
    from a writable root down to a nested repository."""
    out: list[str] = []
    for repo in scan.repos:
        git = os.path.join(repo, ".git")
        if _kind(git) == stat.S_IFDIR:
            out.append(git)
        root = next(r for r in scan.roots if repo == r or repo.startswith(r.rstrip("/") + "/"))
        rel = os.path.relpath(repo, root)
        parts = [] if rel == "." else rel.split(os.sep)
        out += [os.path.join(root, *parts[:i]) for i in range(1, len(parts) + 1)]
    return tuple(p for p in dict.fromkeys(out) if _kind(p) == stat.S_IFDIR)


def _config_targets(git_dir: str, repo: str) -> list[str]:
    """Paths a git config points at for code: core.hooksPath (husky, lefthook: often in the work tree)
    and include.path files. A small reader, not git: agentcell never runs git on a repository an agent
    could have prepared."""
    out: list[str] = []
    section = ""
    try:
        with open(os.path.join(git_dir, "config"), errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for raw in lines:
        line = raw.strip()
        if line.startswith("["):
            section = line.strip("[]").split()[0].lower() if line.strip("[]").split() else ""
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip().lower(), value.split("#")[0].split(";")[0].strip().strip('"')
        if not eq or not value:
            continue
        if section == "core" and key == "hookspath":
            out.append(value if os.path.isabs(value) else os.path.join(repo, value))
        elif section in ("include", "includeif") and key == "path":
            out.append(value if os.path.isabs(value) else os.path.join(git_dir, value))
    return [os.path.normpath(os.path.expanduser(p)) for p in out]


def _candidates(scan: Scan) -> list[str]:
    out: list[str] = list(scan.named)
    for place in (*scan.roots, *scan.repos):
        out += [os.path.join(place, name) for name in AT_REPO_ROOT]
    for repo in scan.repos:
        git = os.path.join(repo, ".git")
        if _kind(git) == stat.S_IFREG:
            out.append(git)  # a gitfile: "gitdir: <where the repository really is>"
        for gd in _git_dirs(repo):
            out += [os.path.join(gd, p) for p in GIT_PARTS]
            out += [t for t in _config_targets(gd, repo)
                    if any(t.startswith(r.rstrip("/") + "/") for r in scan.roots)]
    return out


def protected_paths(scan: Scan, allow_write: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What is bound read-only: every candidate that exists as a file or directory (a symlink cannot
    be bound: it is reported by :func:`surface`)."""
    lifted = tuple(a.rstrip("/") for a in allow_write)
    return tuple(p for p in dict.fromkeys(_candidates(scan))
                 if _kind(p) in (stat.S_IFDIR, stat.S_IFREG)
                 and not any(p == a or p.startswith(a + "/") or a.startswith(p + "/") for a in lifted))


def surface(writable: tuple[str, ...]) -> tuple[dict[str, tuple[int, int, int, int]], bool]:
    """The control surface as (type, inode, size, mtime) per existing entry — compare two of these to
    see what a run created, replaced, changed or removed — and whether the scan was truncated."""
    scan = Scan(writable)
    paths = _candidates(scan)
    for repo in scan.repos:
        paths.append(os.path.join(repo, ".git"))
        for gd in _git_dirs(repo):
            paths += [os.path.join(gd, p) for p in GIT_REDIRECTS]
            try:
                worktrees = os.listdir(os.path.join(gd, "worktrees"))
            except OSError:
                worktrees = []
            for w in worktrees:
                paths += [os.path.join(gd, "worktrees", w, f) for f in ("commondir", "gitdir", "config.worktree")]
    out: dict[str, tuple[int, int, int, int]] = {}
    for p in dict.fromkeys(paths):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        out[p] = (stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns)
    return out, scan.truncated


def changes(before: dict[str, tuple[int, int, int, int]], after: dict[str, tuple[int, int, int, int]]) -> list[str]:
    return sorted(p for p in {*before, *after} if before.get(p) != after.get(p))


def quarantine(before: dict[str, tuple[int, int, int, int]], after: dict[str, tuple[int, int, int, int]],
               cell_id: str, allow_write: tuple[str, ...] = ()) -> tuple[list[tuple[str, str]], list[str]]:
    """Move aside what the run created on the control surface; ([(path, new path)], [not moved]).

    Called when the cell has ended (its processes are gone) and as root possibly: every parent is
    opened without following symlinks and the entry must still be the one the after-scan saw, so a
    swapped path moves nothing outside the project. The new name sits next to the old one (same
    directory, same file system: a rename, nothing copied). An entry below one already moved went
    with it."""
    lifted = tuple(a.rstrip("/") for a in allow_write)
    created = sorted(p for p in after if p not in before
                     and not any(p == a or p.startswith(a + "/") for a in lifted))
    moved: list[tuple[str, str]] = []
    failed: list[str] = []
    for path in created:
        if any(path.startswith(old + "/") for old, _ in moved):
            continue
        parent, name = os.path.split(path)
        new = f"{name}{QUARANTINE}{cell_id}"
        try:
            fd = paths.open_nofollow(parent)
        except LaunchError:
            failed.append(path)
            continue
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if (stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns) != after[path]:
                raise OSError("replaced since the scan")
            os.rename(name, new, src_dir_fd=fd, dst_dir_fd=fd)
            moved.append((path, os.path.join(parent, new)))
        except OSError:
            failed.append(path)
        finally:
            os.close(fd)
    return moved, failed
