"""Where a session's configuration comes from: a ``.env`` and the project's ``agentcell.toml``, read as
root must read a file an agent may have made (no link followed, no FIFO, bounded), and the flags each
setting has. Which of them may decide what is :mod:`.config`'s."""
from __future__ import annotations

import os
import tomllib
from typing import Any

from .. import hostfs
from ..errors import AgentcellError, PolicyError

TOML_KEYS = ("harness", "declared_paths", "agent", "backup_dir", "audit_log_path", "audit_witness",
             "wall_clock_limit_s", "firewall_enabled", "network", "risk", "env", "api_base", "model")
MAX_FILE = 1 << 20  # a .env or agentcell.toml
FLAGS = {"harness": "--harness", "project_root": "--project", "declared_paths": "--rw", "agent": "--agent",
         "backup_dir": "--backup-dir", "audit_log_path": "--audit-log", "audit_witness": "--audit-witness",
         "audit_witness_required": "--audit-witness-required", "wall_clock_limit_s": "--wall-clock",
         "firewall_enabled": "--firewall", "network": "--net", "allow_domains": "--allow-domain",
         "deny_domains": "--deny-domain", "allow_presets": "--allow-preset", "allow_ranges": "--allow-range",
         "resolver": "--resolver", "api_base": "--api-base", "model": "--model", "risk": "--risk", "env": "--env",
         "keep_env": "--keep-env", "home_from": "--home-from", "git_identity": "--git-identity",
         "ceilings": "--ceilings", "cache": "--cache", "workspace": "--workspace",
         "workspace_include": "--workspace-include", "memory": "--memory",
         "cpu": "--cpu",
         "pids": "--pids", "limits": "--limits"}


def read_dotenv(path: str) -> dict[str, str]:
    """``NAME=VALUE`` lines (``export`` allowed, ``#`` comments, values optionally quoted); no expansion."""
    return read_dotenv_owned(path)[0]


def read_dotenv_owned(path: str, *, explicit: bool = False) -> tuple[dict[str, str], bool]:
    """The file's values, and whether it may decide for root: only a file named on the command line
    (``explicit``: the implicit ``./.env`` is the project's, whoever owns it now: an earlier agent may
    have written a root-owned file through its grant and renamed it), reached through directories
    only you or root can change, and only yours or root's itself (:func:`agentcell.hostfs.only_ours`).
    The way is walked by descriptor, never through a link, so what was checked is what is read. A
    regular file of at most 1 MiB. (The project's own root and declared paths are ruled out by
    :func:`.config.load`, which knows them.)"""
    import stat

    fd, dirs_ok = _open_walked(path)
    if fd is None:
        if explicit:  # named on purpose: a typo must not start a session with the defaults
            from ..hostfs import shown

            raise PolicyError("--env-file", f"{shown(path)} does not exist", "name an existing .env file")
        return {}, False
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode) and not explicit:
            return {}, False  # a virtualenv named .env: no configuration here
        lines = _read_regular(fd, path, "point --env-file at a .env file").decode("utf-8").splitlines()
        ours = explicit and dirs_ok and hostfs.only_ours(fd)
    except UnicodeDecodeError:
        raise PolicyError(path, "is not UTF-8 text", "fix its encoding") from None
    finally:
        os.close(fd)
    return _parse_dotenv(path, lines), ours


def _read_regular(fd: int, path: str, fix: str) -> bytes:
    """What ``fd`` holds, read whole, as root must read a file a project's agent may have made
    (:func:`agentcell.hostfs.read_fd`: a regular file, not a FIFO to block on, not /dev/zero, 1 MiB)."""
    from ..hostfs import read_fd

    try:
        return read_fd(fd, path, path, fix, MAX_FILE)
    except AgentcellError as e:  # a project's file refused is the request refused: a PolicyError
        raise PolicyError(e.field, e.problem, e.fix) from None


def _open_walked(path: str) -> tuple[int | None, bool]:
    """``path`` opened for reading (None: it does not exist), and whether every directory on the way
    was reached without a link and is one only you or root can change (a sticky one such as /tmp too,
    when yours or root's: no one else can replace your file there)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    parts = [p for p in os.path.abspath(path).split("/") if p]
    if not parts:
        raise PolicyError(path, "is not a regular file of at most 1 MiB", "point --env-file at a .env file")
    dfd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    dirs_ok = True
    try:
        dirs_ok = hostfs.only_ours(dfd, sticky_ok=True)
        for part in parts[:-1]:
            try:
                nfd = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except OSError:  # a link (or not a directory) on the way: read it by name, never trusted
                dirs_ok, nfd = False, -1
            if nfd < 0:
                break
            os.close(dfd)
            dfd = nfd
            dirs_ok = dirs_ok and hostfs.only_ours(dfd, sticky_ok=True)
        try:
            if dirs_ok:
                return os.open(parts[-1], flags, dir_fd=dfd), True
            return os.open(path, flags), False
        except FileNotFoundError:
            return None, False
        except OSError as e:
            raise PolicyError(path, f"cannot read it ({e.strerror})", "make it a plain readable file") from None
    finally:
        os.close(dfd)


def _inside(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip("/") + "/") for r in map(os.path.realpath, roots))


def _parse_dotenv(path: str, lines: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        name, eq, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise PolicyError(f"{path}:{n}", "this line is not NAME=VALUE", "fix or remove the line")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[name] = value
    return out


def read_toml(project_root: str) -> dict[str, Any]:
    """The ``[session]`` table of ``<project>/agentcell.toml`` ({} without the file or the table)."""
    path = os.path.join(project_root, "agentcell.toml")
    try:  # as root, a file the project's agent may have made: no link followed, no FIFO, bounded
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise PolicyError(path, f"cannot read it ({e.strerror})", "make it a plain readable file, or remove it") \
            from None
    try:
        data = tomllib.loads(_read_regular(fd, path, "make it a plain file, or remove it").decode("utf-8"))
    except ValueError as e:
        raise PolicyError(path, f"not valid TOML: {e}".splitlines()[0], "fix the syntax") from None
    except RecursionError:  # arrays or tables nested thousands deep: the parser's stack
        raise PolicyError(path, "not valid TOML: nested too deep", "fix the syntax") from None
    finally:
        os.close(fd)
    table = data.get("session", {})
    if not isinstance(table, dict):
        raise PolicyError(f"{path}: session", "is not a table", "write it as [session]")
    for key in table:
        if key not in TOML_KEYS:
            raise PolicyError(f"{path}: session.{key}", "unknown key", f"valid keys: {', '.join(TOML_KEYS)}")
    return table
