"""What is protected in the writable paths (the package's docstring says why): the scan that finds the
repositories and the entries git, a shell or a harness would run or load, the control surface's state
before and after a run, and what a change there means.

``core.hooksPath`` and ``include.path`` targets inside the writable paths (husky and the like) are
read from each config (by a small reader: git itself is never run on such a repository) and bound
read-only too.

Known limits: the scan stops at MAX_DEPTH levels and MAX_DIRS directories (a truncated scan is
reported, and an agent can make a tree that big on purpose: entries past the limits are not seen);
dependency and cache directories are looked into only for a repository at their top or one level
down; only the names below are known.
"""
from __future__ import annotations

import os
import stat

from ..cell import paths
from ..errors import LaunchError

QUARANTINE_DIR = ".agentcell-quarantine"
GIT_PARTS = ("hooks", "config")
# Files through which git looks for config or hooks elsewhere: compared before and after a run.
GIT_REDIRECTS = ("commondir", "config.worktree", "info/attributes")
AT_REPO_ROOT = (
    ".gitmodules", ".claude", ".codex", ".cursor", ".vscode", ".idea", ".mcp.json", "opencode.json", "opencode.jsonc",
    ".opencode", ".envrc",
    ".bashrc", ".bash_profile", ".bash_login", ".profile", ".zshrc", ".zprofile", ".zshenv", ".zlogin",
    "AGENTS.md", "CLAUDE.md", "GEMINI.md", ".gemini", ".aider.conf.yml", ".aider.model.settings.yml",
    ".aider.model.metadata.json", ".copilot", "copilot-instructions.md", ".npmrc", ".yarnrc.yml", ".cargo",
    ".devcontainer", ".cursorrules", ".windsurfrules", ".clinerules", "mise.toml", ".nvim.lua",
    ".pre-commit-config.yaml", "lefthook.yml", ".lefthook.yml", "lefthook.yaml", ".husky",
)
_NAMES = frozenset(AT_REPO_ROOT)
SKIP_DIRS = frozenset({"node_modules", ".venv", "venv", "__pycache__", ".tox", ".mypy_cache", ".pytest_cache",
                       ".ruff_cache", "target", ".cache", ".git"})
# What quarantine may move: entries of the structure itself, never a file a config merely names.
STRUCTURE = _NAMES | {".git", "HEAD", "commondir", "config.worktree", "attributes", "gitdir", *GIT_PARTS}
MAX_CONFIG = 1 << 20
MAX_DEPTH = 8
MAX_DIRS = 5000  # a scan that far costs ~100 ms here (/usr/share); a run scans up to three times
MAX_MODULE_DEPTH = 8


class Scan:
    """Repositories below the writable roots, and whether the scan hit one of its limits."""

    def __init__(self, writable: tuple[str, ...]) -> None:
        self.roots = tuple(r for r in writable if os.path.isdir(r))
        self.truncated = False
        self.repos: list[str] = []
        self.bare: list[str] = []  # directories git would take for a bare repository
        self.named: list[str] = []  # harness or shell entries found at any depth (nested CLAUDE.md, …)
        self.attributes: list[str] = []  # .gitattributes at any depth: compared, never bound (work files)
        # The repository each root lies in, when it is above the root: its config may point inside
        # the root (core.hooksPath = .github/hooks with .github declared), which a scan starting at
        # the root would never read.
        self.enclosing: list[str] = []
        for root in self.roots:
            self._walk(root)
            up = os.path.dirname(root)
            while up != os.path.dirname(up):  # every one: a submodule's superproject may point into it too
                if os.path.lexists(os.path.join(up, ".git")) and up not in self.enclosing:
                    self.enclosing.append(up)
                up = os.path.dirname(up)

    def _walk(self, root: str) -> None:
        level, seen = [root], 0
        for depth in range(MAX_DEPTH + 1):
            nxt: list[str] = []
            for d in level:
                try:
                    entries = list(os.scandir(d))
                except OSError:
                    continue
                names = {e.name for e in entries}
                if ".git" in names:
                    self.repos.append(d)
                if "HEAD" in names and ("objects" in names or "refs" in names):
                    self.bare.append(d)
                self.named += [e.path for e in entries if e.name in _NAMES]
                if ".gitattributes" in names:
                    self.attributes.append(os.path.join(d, ".gitattributes"))
                for e in entries:
                    if not e.is_dir(follow_symlinks=False):
                        continue
                    if e.name.startswith(QUARANTINE_DIR):
                        continue
                    if e.name in SKIP_DIRS:
                        if e.name != ".git":
                            self._skipped(e.path)
                        continue
                    seen += 1
                    if seen > MAX_DIRS or depth == MAX_DEPTH:
                        self.truncated = True
                        if seen > MAX_DIRS:
                            return
                        continue
                    nxt.append(e.path)
            level = nxt


    def _skipped(self, d: str) -> None:
        """A dependency or cache directory is not walked, but a repository at its top or one level
        down (node_modules/pkg/.git) is still found."""
        try:
            below = [e.path for e in os.scandir(d) if e.is_dir(follow_symlinks=False)][:MAX_DIRS]
        except OSError:
            return
        for place in (d, *below):
            if os.path.lexists(os.path.join(place, ".git")):
                self.repos.append(place)


def _real_dir(path: str) -> bool:
    return _kind(path) == stat.S_IFDIR  # lstat: a symlink is not one


def _git_dirs(repo: str) -> list[str]:
    return [gd for gd, _ in _git_dirs_worktrees(repo)]


def _git_dirs_worktrees(repo: str) -> list[tuple[str, str]]:
    """The repository's own git directory (a ``.git`` directory, or the one a ``.git`` file names)
    and every submodule's under its ``modules``, at any depth (MAX_MODULE_DEPTH levels, MAX_DIRS
    directories), each with the work tree its relative ``core.hooksPath`` is taken from (a
    submodule's: its ``core.worktree``). Never through a symlink: ``.git/modules`` made a link to /
    would otherwise have the supervisor walk the host."""
    git = os.path.join(repo, ".git")
    if _kind(git) == stat.S_IFREG:
        named = _gitfile_target(git)
        git = named if named and _real_dir(named) else ""
    elif not _real_dir(git):
        git = ""
    if not git:
        return []
    found, seen = [(git, repo)], 0
    level = [m for m in (os.path.join(git, "modules"),) if _real_dir(m)]
    for _ in range(MAX_MODULE_DEPTH):
        nxt: list[str] = []
        for d in level:
            try:
                entries = [e for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for e in entries:
                seen += 1
                if seen > MAX_DIRS:
                    return found
                if os.path.lexists(os.path.join(e.path, "HEAD")):
                    wt = _config_value(e.path, "core", "worktree")
                    found.append((e.path, os.path.normpath(os.path.join(e.path, wt)) if wt else
                                  os.path.join(repo, os.path.relpath(e.path, os.path.join(git, "modules")))))
                    if _real_dir(os.path.join(e.path, "modules")):
                        nxt.append(os.path.join(e.path, "modules"))
                else:
                    nxt.append(e.path)  # a submodule named a/b: its git dir is modules/a/b
        level = nxt
    return found


def _gitfile_target(gitfile: str) -> str | None:
    """Where a ``.git`` file ("gitdir: <path>") says the repository is (relative to its directory)."""
    text = _read_small(os.path.dirname(gitfile), os.path.basename(gitfile), 4096)
    line = text.splitlines()[0] if text else ""
    if not line.startswith("gitdir:") or "\0" in line:
        return None
    target = line[len("gitdir:"):].strip()
    return os.path.normpath(os.path.join(os.path.dirname(gitfile), target))


def _with_real(targets: list[str]) -> list[str]:
    """Each path as written and as it resolves: a link made in its place is seen (and reported), and
    what it reaches inside the writable paths is bound."""
    return [q for t in targets for q in dict.fromkeys((t, os.path.realpath(t)))]


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)[:MAX_DIRS] if _real_dir(d) else []
    except OSError:
        return []


def _kind(path: str) -> int | None:
    try:
        return stat.S_IFMT(os.lstat(path).st_mode)
    except (OSError, ValueError):  # ValueError: a NUL in a name a config gave
        return None


def repositories(writable: tuple[str, ...]) -> list[str]:
    """The repositories below the writable roots (each a work tree with a ``.git``), as far as the scan goes."""
    return list(dict.fromkeys(Scan(writable).repos))


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


MAX_INCLUDES = 20  # config files read per git directory, includes followed


def _parse_config(text: str) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line.strip("[]").split()[0].lower() if line.strip("[]").split() else ""
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip().lower(), value.split("#")[0].split(";")[0].strip().strip('"')
        if eq and value and "\0" not in value:
            out.append((section, key, value))
    return out


def _config_entries(git_dir: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of a git dir's own config and config.worktree (a small reader, not git:
    agentcell never runs git on a repository an agent could have prepared)."""
    return [e for name in ("config", "config.worktree") for e in _parse_config(_read_small(git_dir, name, MAX_CONFIG))]


def _config_value(git_dir: str, section: str, key: str) -> str | None:
    return next((v for s, k, v in reversed(_config_entries(git_dir)) if s == section and k == key), None)


def config_targets(git_dir: str, worktree: str) -> list[str]:
    """What the config of ``git_dir`` points git at for code (see :func:`_config_targets`)."""
    return _config_targets(git_dir, worktree)


def _config_targets(git_dir: str, worktree: str) -> list[str]:
    """Paths the config git reads for this git dir points at for code: core.hooksPath (husky,
    lefthook: often in the work tree; relative to the work tree, a submodule's or a linked
    worktree's own; ``~`` is the human's home) and include.path / includeIf files, whose own
    contents are read too (up to MAX_INCLUDES files). A linked worktree's git dir has little config of
    its own: the shared one is found through its ``commondir``."""
    files: list[tuple[str, str]] = [(git_dir, "config"), (git_dir, "config.worktree")]
    common = _read_small(git_dir, "commondir", 4096).strip()
    if common and "\0" not in common:
        common_dir = os.path.normpath(os.path.join(git_dir, common))
        files += [(common_dir, "config"), (common_dir, "config.worktree")]
    out: list[str] = []
    read: set[str] = set()
    budget = 2 * MAX_CONFIG  # bytes for all the files of one git dir: includes multiply nothing
    while files and len(read) < MAX_INCLUDES and budget > 0:
        directory, name = files.pop(0)
        if os.path.join(directory, name) in read:
            continue
        read.add(os.path.join(directory, name))
        text = _read_small(directory, name, min(MAX_CONFIG, budget))
        budget -= len(text)
        for section, key, value in _parse_config(text):
            if section == "core" and key == "hookspath":
                out.append(os.path.join(worktree, _expand_home(value)))  # an absolute one stays as it is
            elif section in ("include", "includeif") and key == "path":
                target = os.path.normpath(os.path.join(directory, _expand_home(value)))
                out.append(target)
                files.append((os.path.dirname(target), os.path.basename(target)))
    return [os.path.normpath(p) for p in out]


def _expand_home(value: str) -> str:
    """``~`` as git expands it: the home of the person who will run git (behind sudo: theirs)."""
    if not value.startswith("~/") and value != "~":
        return value
    import pwd

    uid = os.environ.get("SUDO_UID", "")
    try:
        home = pwd.getpwuid(int(uid)).pw_dir if uid.isdigit() else os.path.expanduser("~")
    except KeyError:
        home = os.path.expanduser("~")
    return home + value[1:]


def _read_small(directory: str, name: str, limit: int) -> str:
    """A file an agent may have written, read as the supervisor (root, maybe) must: no symlink
    followed anywhere on the way, a regular file only (not a FIFO to block on, not /dev/zero), at
    most ``limit`` bytes."""
    try:
        dfd = paths.open_nofollow(directory)
    except LaunchError:
        return ""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return ""
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        # A regular file with a size: /proc and /sys files say 0 (and /proc/kmsg is consumed by reading).
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return ""
        return os.read(fd, min(limit, st.st_size)).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _candidates(scan: Scan) -> list[str]:
    out: list[str] = list(scan.named)
    for place in (*scan.roots, *scan.repos):
        out += [os.path.join(place, name) for name in AT_REPO_ROOT]
    for bare in scan.bare:
        out += [os.path.join(bare, name) for name in ("HEAD", *GIT_PARTS)]
    for repo in scan.repos:
        git = os.path.join(repo, ".git")
        if _kind(git) == stat.S_IFREG:
            out.append(git)  # a gitfile: "gitdir: <where the repository really is>"
        for gd, worktree in _git_dirs_worktrees(repo):
            out += [os.path.join(gd, p) for p in (*GIT_PARTS, *GIT_REDIRECTS)]
            out += [os.path.join(gd, "worktrees", w, f) for w in _listdir(os.path.join(gd, "worktrees"))
                    for f in ("commondir", "gitdir", "config.worktree")]
            out += [t for t in _with_real(_config_targets(gd, worktree))
                    if any(t.startswith(r.rstrip("/") + "/") for r in scan.roots)]
    for repo in scan.enclosing:  # above a root: only what its config points at inside one
        for gd, worktree in _git_dirs_worktrees(repo):
            out += [t for t in _with_real(_config_targets(gd, worktree))
                    if any(t.startswith(r.rstrip("/") + "/") for r in scan.roots)]
    # A .git file may name a git directory anywhere: what lies outside the roots is not the cell's
    # to see, and must not be bound into it.
    return [p for p in out if any(p == r or p.startswith(r.rstrip("/") + "/") for r in scan.roots)]


def protected_paths(scan: Scan, allow_write: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What is bound read-only: every candidate that exists as a file or directory (a symlink cannot
    be bound: it is reported by :func:`surface`)."""
    lifted = tuple(a.rstrip("/") for a in allow_write)
    return tuple(p for p in dict.fromkeys(_candidates(scan))
                 if _kind(p) in (stat.S_IFDIR, stat.S_IFREG)
                 and not any(p == a or p.startswith(a + "/") for a in lifted))


def creatable(scan: Scan, allow_write: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Protected entries that do not exist yet, in a directory that does: what a command could create
    (and the monitor watches for, live: it cannot be bound read-only)."""
    lifted = tuple(a.rstrip("/") for a in allow_write)
    return tuple(p for p in dict.fromkeys(_candidates(scan))
                 if _kind(p) is None and _kind(os.path.dirname(p)) == stat.S_IFDIR
                 and not any(p == a or p.startswith(a + "/") for a in lifted))


def lifted_inside(protected: tuple[str, ...], allow_write: tuple[str, ...]) -> tuple[str, ...]:
    """Lifted paths that exist inside a protected directory: bound writable on top of its read-only
    bind (only that entry is lifted, not the directory around it)."""
    return tuple(a for a in allow_write if _kind(a) in (stat.S_IFDIR, stat.S_IFREG)
                 and any(a.startswith(p.rstrip("/") + "/") for p in protected))


def protected_surface(root: str) -> tuple[tuple[str, ...], bool]:
    """Every protected entry found below ``root`` (real paths): git directories' hooks and config,
    core.hooksPath and include.path targets (of a repository enclosing ``root`` too), bare
    repositories' parts, harness and shell names at any depth. What a project's own files may not
    declare writable. And whether the scan was cut short (then some may be missing)."""
    scan = Scan((root,))
    return tuple(os.path.realpath(p) for p in dict.fromkeys(_candidates(scan)) if _kind(p) is not None), \
        scan.truncated


def protected_part(path: str, root: str) -> str | None:
    """The protected entry ``path`` is or lies inside, relative to ``root`` (a ``.git`` directory, a
    harness or shell name, a git directory's hooks or config), or None."""
    rel = os.path.relpath(os.path.normpath(path), os.path.normpath(root))
    if rel == "." or rel.startswith(".."):
        return None
    parts = rel.split(os.sep)
    for i, part in enumerate(parts):
        if part in _NAMES or part == ".git":
            return os.path.join(root, *parts[:i + 1])
    return None


def allow_write_problem(path: str, writable: tuple[str, ...]) -> str:
    """Why ``--allow-write path`` cannot work as asked ('' if it can): a path that does not exist yet
    inside a protected directory could only be created by lifting the whole directory."""
    if _kind(path) is not None:
        return ""
    root = next((r for r in writable if path.startswith(r.rstrip("/") + "/")), None)
    if root is None:
        return ""
    rel = os.path.relpath(os.path.dirname(path), root)
    parts = [] if rel == "." else rel.split(os.sep)
    for i, part in enumerate(parts):
        if part in STRUCTURE:
            where = os.path.join(root, *parts[:i + 1])
            return f"{path} does not exist and lies inside the protected {where}; name {where} itself to let " \
                   "the command create entries there"
    return ""


def surface(writable: tuple[str, ...]) -> tuple[dict[str, tuple[int, int, int, int]], bool]:
    """The control surface as (type, inode, size, mtime) per existing entry — compare two of these to
    see what a run created, replaced, changed or removed — and whether the scan was truncated."""
    scan = Scan(writable)
    paths = _candidates(scan) + scan.attributes
    for repo in scan.repos:
        paths.append(os.path.join(repo, ".git"))
        for gd in _git_dirs(repo):
            if not any(gd.startswith(r.rstrip("/") + "/") for r in scan.roots):
                continue
            paths += [os.path.join(gd, p) for p in GIT_REDIRECTS]
            try:
                wt = os.path.join(gd, "worktrees")
                worktrees = os.listdir(wt)[:MAX_DIRS] if _real_dir(wt) else []
            except OSError:
                worktrees = []
            for w in worktrees:
                paths += [os.path.join(gd, "worktrees", w, f) for f in ("commondir", "gitdir", "config.worktree")]
    out: dict[str, tuple[int, int, int, int]] = {}
    for p in dict.fromkeys(paths):
        try:
            st = os.lstat(p)
        except (OSError, ValueError):
            continue
        kind = stat.S_IFMT(st.st_mode)
        if kind == stat.S_IFDIR and os.path.basename(p) == ".git":  # git's own work changes it all the time:
            out[p] = (kind, st.st_ino, 0, 0)  # what counts is that it is the same directory
        else:
            out[p] = (kind, st.st_ino, st.st_size, st.st_mtime_ns)
    return out, scan.truncated


def changes(before: dict[str, tuple[int, int, int, int]], after: dict[str, tuple[int, int, int, int]],
            meant_before: dict[str, str] | None = None) -> list[str]:
    """What differs between two surfaces; with ``meant_before`` (:func:`meanings` of the first), a file
    whose :func:`meaning` did not change is left out (a rewrite that decides nothing new: a
    ``.gitattributes`` line that names no driver, a config written back the same)."""
    meant = meant_before or {}

    def meant_something(p: str) -> bool:
        if _attributes(p):  # (one that names no driver, made or removed, is as good as none)
            return (meaning(p) or "") != meant.get(p, "")
        return p not in before or p not in after or p not in meant or meaning(p) != meant[p]

    changed = [p for p in {*before, *after} if before.get(p) != after.get(p)]
    return sorted(p for p in changed if meant_before is None or meant_something(p))


def _attributes(path: str) -> bool:
    return os.path.basename(path) in (".gitattributes", "attributes")


# ---- what a change on the control surface means ----------------------------------------------------

DRIVERS = ("filter", "diff", "merge")  # attributes that name a command git's config defines


def meanings(surface_: dict[str, tuple[int, int, int, int]]) -> dict[str, str]:
    """:func:`meaning` of each entry of a surface that has one."""
    return {p: m for p in surface_ if (m := meaning(p)) is not None}


def meaning(path: str) -> str | None:
    """What in ``path`` decides what runs, as text to compare and to show: a git config file's entries
    (``section.key=value``, one a line, sorted), the lines of an attributes file that name a driver
    (filter, diff, merge), a hooks directory's files (name, size, mode); any other regular file's
    SHA-256. None for what is not there, or not a file this knows."""
    import hashlib
    import json

    name, parent = os.path.basename(path), os.path.dirname(path)
    kind = _kind(path)
    if kind == stat.S_IFDIR and name == "hooks":
        listing = {}
        for entry in _listdir(path):
            try:
                st = os.lstat(os.path.join(path, entry))
            except OSError:
                continue
            listing[entry] = [st.st_size, oct(st.st_mode)]
        return json.dumps(listing, sort_keys=True)
    if kind != stat.S_IFREG:
        return None
    if name in ("config", "config.worktree") and os.path.lexists(os.path.join(parent, "HEAD")):
        return "\n".join(sorted(f"{s}.{k}={v}" for s, k, v in _parse_config(_read_small(parent, name, MAX_CONFIG))))
    if name in (".gitattributes", "attributes"):
        lines = (line.split() for line in _read_small(parent, name, MAX_CONFIG).splitlines())
        return "\n".join(sorted({" ".join(words) for words in lines if words and not words[0].startswith("#")
                                  and any(w.startswith(tuple(f"{d}=" for d in DRIVERS)) for w in words[1:])}))
    data = _read_small(parent, name, MAX_CONFIG)
    return "sha256:" + hashlib.sha256(data.encode()).hexdigest()


def describe(path: str, before: str | None, after: str | None) -> str:
    """What changed in ``path``, said as the human reads it (from two :func:`meaning` texts)."""
    import json

    name = os.path.basename(path)
    if before is None and after is None:
        return "changed"
    if after is None:
        return "removed"
    if name == "hooks":
        old, new = json.loads(before or "{}"), json.loads(after)
        said = [f"hook {h} created" for h in sorted(set(new) - set(old))]
        said += [f"hook {h} removed" for h in sorted(set(old) - set(new))]
        said += [f"hook {h} changed" for h in sorted(set(old) & set(new)) if old[h] != new[h]]
        return "; ".join(said) or "changed"
    if after.startswith("sha256:") or (before or "").startswith("sha256:"):
        return "created" if before is None else "its content changed"
    old_lines, new_lines = set((before or "").splitlines()) - {""}, set(after.splitlines()) - {""}
    added, gone = sorted(new_lines - old_lines), sorted(old_lines - new_lines)
    what = "driver lines" if name in (".gitattributes", "attributes") else "settings"
    said = [f"{what} added: " + ", ".join(_shown(x) for x in added[:8])] if added else []
    said += [f"{what} removed: " + ", ".join(_shown(x) for x in gone[:8])] if gone else []
    return "; ".join(said) or "changed"


def _shown(text: str) -> str:
    from ..errors import printable

    text = printable(text)
    return repr(text if len(text) <= 120 else text[:120] + "...")
