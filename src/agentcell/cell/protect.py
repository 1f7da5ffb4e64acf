"""Protected paths inside writable projects: what an agent could plant for a human to run later.

Git runs ``.git/hooks/*`` and what ``.git/config`` says (``core.fsmonitor``, ``core.hooksPath``,
aliases) when the human next uses the repository; harness config (``.claude/``, ``.mcp.json``, …)
decides what the human's next agent may do; ``.envrc`` and shell rc files run in the human's shell.
Every such entry that exists in a writable path (at its root, and in every repository found below
it) is re-bound read-only, and every ``.git`` directory is pinned in place (ordinary ``git add``/
``commit`` keep working: objects, refs and the index stay writable). ``--allow-write PATH`` lifts one.

Limits, said plainly: entries that do not exist yet are not covered (covering them would mean
writing placeholders into the user's project), and the scan for nested repositories stops at
MAX_DEPTH levels and MAX_DIRS directories and skips dependency and cache directories.
"""
from __future__ import annotations

import os
import stat

GIT_PARTS = ("hooks", "config")
AT_REPO_ROOT = (
    ".gitmodules", ".claude", ".codex", ".cursor", ".vscode", ".idea", ".mcp.json", "opencode.json", ".envrc",
    ".bashrc", ".bash_profile", ".bash_login", ".profile", ".zshrc", ".zprofile", ".zshenv", ".zlogin",
    "AGENTS.md", "CLAUDE.md",
)
SKIP_DIRS = frozenset({"node_modules", ".venv", "venv", "__pycache__", ".tox", ".mypy_cache", ".pytest_cache",
                       ".ruff_cache", "target", ".cache", ".git"})
MAX_DEPTH = 6
MAX_DIRS = 20000


def _exists_plain(path: str) -> bool:
    """Exists and is not a symlink (a symlink cannot be bound; its target is judged on its own)."""
    try:
        return not stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def _repos(root: str) -> list[str]:
    """``root`` and every directory below it holding a ``.git``, breadth-first within the bounds."""
    found: list[str] = []
    level, seen = [root], 0
    for _ in range(MAX_DEPTH + 1):
        nxt: list[str] = []
        for d in level:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            if any(e.name == ".git" for e in entries):
                found.append(d)
            for e in entries:
                if e.name in SKIP_DIRS or not e.is_dir(follow_symlinks=False):
                    continue
                seen += 1
                if seen > MAX_DIRS:
                    return found
                nxt.append(e.path)
        level = nxt
    return found


def pinned_paths(writable: tuple[str, ...]) -> tuple[str, ...]:
    """Directories to bind onto themselves, writable, so that inside the cell they are mount points
    and cannot be renamed away and rebuilt: every repository's ``.git`` (else ``mv .git x; mkdir -p
    .git/hooks`` plants hooks past the read-only bind), and every directory on the way from a
    writable root down to a nested repository."""
    out: list[str] = []
    for root in writable:
        if not os.path.isdir(root):
            continue
        for repo in _repos(root):
            git = os.path.join(repo, ".git")
            if os.path.isdir(git) and not os.path.islink(git):
                out.append(git)
            rel = os.path.relpath(repo, root)
            parts = [] if rel == "." else rel.split(os.sep)
            out += [os.path.join(root, *parts[:i]) for i in range(1, len(parts) + 1)]
    return tuple(p for p in dict.fromkeys(out) if _exists_plain(p))


def protected_paths(writable: tuple[str, ...], allow_write: tuple[str, ...] = ()) -> tuple[str, ...]:
    out: list[str] = []
    for root in writable:
        if not os.path.isdir(root):
            continue
        out += [os.path.join(root, name) for name in AT_REPO_ROOT]  # harness config: repository or not
        for repo in _repos(root):
            git = os.path.join(repo, ".git")
            if os.path.isdir(git) and not os.path.islink(git):
                out += [os.path.join(git, p) for p in GIT_PARTS]
                try:
                    modules = [os.path.join(git, "modules", m) for m in os.listdir(os.path.join(git, "modules"))]
                except OSError:
                    modules = []
                out += [os.path.join(m, p) for m in modules for p in GIT_PARTS]
            out += [os.path.join(repo, name) for name in AT_REPO_ROOT]
    lifted = tuple(a.rstrip("/") for a in allow_write)
    keep = [p for p in dict.fromkeys(out) if _exists_plain(p)
            and not any(p == a or p.startswith(a + "/") or a.startswith(p + "/") for a in lifted)]
    return tuple(keep)
