"""The env files of a session's declared paths: found (any depth, bounded, no link followed) so that
the session hides them from the agent, and fingerprinted so that cleanup can tell one it changed."""
from __future__ import annotations

import os
import stat

SKIP_DIRS = frozenset({".git", "node_modules", ".venv", "venv", "__pycache__", ".tox", ".mypy_cache", "target"})


ENV_NAMES = frozenset({".envrc", ".envs", ".flaskenv", ".dev.vars", ".secrets", "secrets.toml", ".secrets.toml"})


def is_env_file(name: str) -> bool:
    """Names people keep secrets under, in any case, and the copies editors and file managers make of
    them: .env, .env.local, .env-prod, .env_test, ".env 2", .env(1), prod.env, prod.env.local,
    x.env.bak, .envrc, .envs (cookiecutter's directory), .flaskenv, .dev.vars, secrets.toml;
    .env~, #.env#, vim's ..env.swp. Not .environment or env.py."""
    raw = name.lower()
    for n in {raw, raw.strip("#").rstrip("~"), raw[1:-4] if raw.startswith(".") and
              raw.endswith((".swp", ".swo", ".swx")) else raw}:
        if n in ENV_NAMES or (n.startswith(".env") and (len(n) == 4 or not n[4].isalnum())) or \
                ".env." in n or (n.endswith(".env") and len(n) > 4):
            return True
    return False


MAX_ENV_DIRS = 50_000


def dotenv_files(declared: list[str], *, max_dirs: int = MAX_ENV_DIRS) -> tuple[list[str], str | None]:
    """Every env file or directory (:func:`is_env_file`) in the declared paths, at any depth, and the
    file an env-named link points at when it lies in them: the secrets people keep there are not the
    agent's. Links are not followed. Dependency and VCS trees are looked into two levels deep. The
    walk is bounded by directories (not files, not depth: an explicit stack), and says where it
    stopped when cut short (the session is then refused: what lies past it would not be hidden)."""
    out: list[str] = []
    roots = [os.path.realpath(d) for d in declared]
    todo = [(r, 0) for r in roots]  # (directory, levels left below a dependency tree's top; 0: no bound)
    seen = 0
    while todo:
        d, left = todo.pop()
        seen += 1
        if seen > max_dirs:
            return sorted(set(out)), d
        try:
            entries = list(os.scandir(d))
        except OSError:  # gone, unreadable, or a name past PATH_MAX (only an agent makes those)
            continue
        for e in entries:
            if is_env_file(e.name):
                if e.is_file(follow_symlinks=False):
                    out.append(e.path)
                elif e.is_dir(follow_symlinks=False):
                    if os.path.lexists(os.path.join(e.path, "pyvenv.cfg")):  # python -m venv .env
                        todo.append((e.path, 2))  # a virtualenv: searched like one
                    else:
                        out.append(e.path)  # .envs/, .env.d/: hidden whole
                elif e.is_symlink():
                    target = os.path.realpath(e.path)
                    if os.path.exists(target) and any(target.startswith(r.rstrip("/") + "/") for r in roots):
                        out.append(target)
            elif e.is_dir(follow_symlinks=False) and left != 1 and e.name != ".git":
                if left == 0 and e.name in SKIP_DIRS:
                    todo.append((e.path, 2))  # its top and one level below: node_modules/pkg/.env
                else:
                    todo.append((e.path, left - 1 if left else 0))
    return sorted(set(out)), None


def fingerprint(path: str) -> str | None:
    import hashlib

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return "unreadable"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)
