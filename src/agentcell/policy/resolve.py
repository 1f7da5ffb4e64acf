"""Turn user input (paths, identity, environment) into concrete values, refusing what is unsafe.

Standard library only: both the pydantic ``compile`` step and the fast ``agentcell run`` path use
these functions, so the rules live in one place. Every refusal is a :class:`PolicyError` naming the
field and the fix.
"""
from __future__ import annotations

import os
import pwd
import stat

from .. import hostfs
from ..cell.spec import DEFAULT_PATH, TYPE_CHECKING, Identity
from ..errors import PolicyError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

# Credential stores a cell must never be handed, even read-only, without an explicit override.
CREDENTIAL_NAMES = frozenset({
    ".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".password-store", ".netrc", ".pgpass",
    ".git-credentials", ".npmrc", ".pypirc", ".vault-token", ".terraform.d",
})
CREDENTIAL_SUBPATHS = (".config/gcloud", ".config/gh", ".local/share/keyrings", ".mozilla", ".config/google-chrome")
# The launcher provides these itself; binding the host's would undo the cell.
PROVIDED = frozenset({"/proc", "/dev", "/sys/fs/cgroup"})
# Writable system trees would let the command change what every later process runs.
SYSTEM = frozenset({"/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/var",
                    "/run", "/opt", "/srv", "/sys", "/root", "/home", "/tmp", "/mnt", "/media"})
UNSAFE_FLAG = "--allow-unsafe-path"
# Where root's services keep what they later act on (dpkg's maintainer scripts, logs, spools, runtime
# sockets) and where agentcell keeps its own records: never writable for a cell.
SERVICE_STATE = ("/var/lib", "/var/log", "/var/spool", "/var/cache", "/var/backups", "/var/mail", "/run",
                 "/var/run")


def is_env_name(name: str) -> bool:
    """[A-Za-z_][A-Za-z0-9_]* (no ``re``: it costs ~10 ms to import on the ``agentcell run`` path)."""
    return bool(name) and name.isascii() and not name[0].isdigit() and name.replace("_", "a").isalnum()


_NOT_HOMES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/dev", "/proc", "/sys", "/etc", "/run")


def home_dirs() -> set[str]:
    """Every account's home (also service accounts' such as /var/www), except system directories that
    serve as a placeholder home (bin: /bin, daemon: /usr/sbin, nobody: /nonexistent)."""
    homes = {"/root", "/home"}
    for pw in pwd.getpwall():
        d = pw.pw_dir.rstrip("/")
        if d and d != "/nonexistent" and not any(d == s or d.startswith(s + "/") for s in _NOT_HOMES):
            homes.add(os.path.realpath(d))
    return homes


def _trusted_link(link: os.stat_result, parent: os.stat_result) -> bool:
    """A symlink only root could have made: root's, in a root-owned directory nobody else may write."""
    return link.st_uid == 0 and stat.S_ISDIR(parent.st_mode) and hostfs.changeable_only_by(parent, hostfs.ROOT)


def walk(path: str, field: str) -> str:
    """Resolve an absolute path component by component. Only symlinks root alone could have made
    (like /bin -> usr/bin) are followed: a symlink in a directory an agent can write may have been
    planted by it (a declared ``P/build`` pointing at someone's home), so it is refused."""
    parts = [p for p in os.path.normpath(path).split("/") if p]
    cur, i, hops = "/", 0, 0
    while i < len(parts):
        nxt = os.path.join(cur, parts[i])
        st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(nxt)
            if not _trusted_link(st, os.lstat(cur)):
                raise PolicyError(field, f"{nxt} is a symlink (to {target}) that someone other than root could have "
                                  "made", "name the real path instead")
            hops += 1
            if hops > 40:
                raise PolicyError(field, f"{path}: too many levels of symlinks")
            parts = [p for p in os.path.normpath(os.path.join(cur, target, *parts[i + 1:])).split("/") if p]
            cur, i = "/", 0
            continue
        cur, i = nxt, i + 1
    return cur


def resolve_path(path: str, *, field: str, writable: bool, allow_unsafe: bool = False,
                 homes: set[str] | None = None) -> str:
    """Resolve ``path`` once (no untrusted symlinks) and refuse declarations that would open the host."""
    if not path:
        raise PolicyError(field, "empty path", "give a directory or file path")
    try:
        real = walk(os.path.abspath(os.path.expanduser(path)), field)
    except FileNotFoundError:
        raise PolicyError(field, f"{path} does not exist", "create it first or correct the path") from None
    except OSError as e:
        raise PolicyError(field, f"{path}: {e.strerror}", "check the path and its permissions") from None
    why = _unsafe_reason(real, writable, homes if homes is not None else home_dirs())
    if why and not allow_unsafe:
        raise PolicyError(field, f"{path} is refused: {why}", f"name a narrower path, or pass {UNSAFE_FLAG} "
                          "if you really mean it")
    return real


def _unsafe_reason(real: str, writable: bool, homes: set[str]) -> str:
    if real == "/":
        return "it is the whole host filesystem"
    if real in PROVIDED or any(real.startswith(p + "/") for p in ("/proc", "/dev")):
        return "the cell provides its own /proc and /dev"
    if real in homes:
        return "it is a home directory itself (declare the project inside it)"
    parts = real.split("/")
    if any(p in CREDENTIAL_NAMES for p in parts):
        return "it is (inside) a credential store"
    if any(f"/{sub}/" in real + "/" for sub in CREDENTIAL_SUBPATHS):
        return "it is (inside) a credential store"
    if writable and (real in SYSTEM or any(real.startswith(s + "/") for s in ("/usr", "/etc", "/boot", "/bin",
                                                                                "/sbin", "/lib", "/lib64"))):
        return "it is a system directory and would be writable"
    if writable and (any(real == s or real.startswith(s + "/") for s in SERVICE_STATE)
                     or "/.local/state/agentcell/" in real + "/"):
        return "it holds the system's or agentcell's own state (package database, logs, spools, runtime files)"
    return ""


def resolve_allowed_write(path: str, *, field: str, homes: set[str] | None = None) -> str:
    """A protected path the command may write: it may not exist yet (the command is to create it,
    e.g. AGENTS.md), but its directory must, resolved as strictly as any declared path."""
    full = os.path.abspath(os.path.expanduser(path)) if path else ""
    if full and not os.path.lexists(full) and os.path.basename(full) not in ("", ".", ".."):
        parent = resolve_path(os.path.dirname(full), field=field, writable=True, allow_unsafe=True, homes=homes)
        return os.path.join(parent, os.path.basename(full))
    return resolve_path(path, field=field, writable=True, allow_unsafe=True, homes=homes)


def allowed_writes(paths: Iterable[str], rw: tuple[str, ...], *, field: str, homes: set[str] | None = None,
                   fix: str = "share its project with --rw") -> tuple[str, ...]:
    """Protected paths the policy lets the command write (:mod:`agentcell.protect`): each resolved,
    inside a writable declared path, and one the protected-path rules allow lifting. The one check
    for ``--allow-write`` and a plan's ``allow_write``."""
    out: list[str] = []
    for p in paths:
        real = resolve_allowed_write(p, field=field, homes=homes)
        if cell_cwd(real, rw, "") != real:
            raise PolicyError(field, f"{p} is not inside a declared writable path", fix)
        from ..protect import surface

        why = surface.allow_write_problem(real, rw)
        if why:
            raise PolicyError(field, why)
        if real not in out:
            out.append(real)
    return tuple(out)


def resolve_paths(paths: Iterable[str], **kw: object) -> tuple[str, ...]:
    out: list[str] = []
    for p in paths:
        r = resolve_path(p, **kw)  # type: ignore[arg-type]
        if r not in out:
            out.append(r)
    return tuple(out)


# The cell's own, made fresh in it: a mask over them (or over / itself) would leave nothing to run.
CELL_OWN = ("/proc", "/dev")


def check_masks(paths: Iterable[str], field: str = "--mask") -> None:
    """A mask hides a path inside the cell: never /, nor the cell's own /proc and /dev or what holds them."""
    for p in paths:
        if p == "/" or any(p == own or own.startswith(p.rstrip("/") + "/") or p.startswith(own + "/")
                           for own in CELL_OWN):
            what = "the whole file system" if p == "/" else "the cell's own (made fresh in it)"
            raise PolicyError(field, f"{p} is {what}: a mask over it would leave nothing to run",
                              "mask a path of the host inside it")


def check_disjoint(groups: Mapping[str, tuple[str, ...]]) -> None:
    """A path may be declared once: rw and ro (or masked) at the same place is ambiguous."""
    seen: dict[str, str] = {}
    for field, paths in groups.items():
        for p in paths:
            if p in seen and seen[p] != field:
                raise PolicyError(field, f"{p} is also given to {seen[p]}", "declare each path once")
            seen[p] = field


def _home_for(pw: pwd.struct_passwd | None, name: str) -> str:
    home = pw.pw_dir if pw else ""
    if home.startswith("/home/") and home.count("/") == 2:
        return home
    return f"/home/{name}"


def resolve_identity(as_: str | None, *, euid: int | None = None, environ: Mapping[str, str] | None = None) -> Identity:
    """Who the command runs as. Never global uid 0: root must name a non-root account."""
    euid = os.geteuid() if euid is None else euid
    environ = os.environ if environ is None else environ
    spec = as_ or "self"
    if euid != 0:
        if spec != "self":
            raise PolicyError("--as", f"'{spec}' needs root", "run agentcell through sudo, or use --as self")
        pw = _pw(euid)
        name = pw.pw_name if pw else str(euid)
        return Identity("self", euid, os.getegid(), name, _home_for(pw, name))
    if spec == "self":
        sudo_uid = environ.get("SUDO_UID", "")
        if not sudo_uid.isdigit() or int(sudo_uid) == 0:
            raise PolicyError("--as", "agentcell will not run a command as root",
                              "pass --as agent:NAME or --as UID naming a non-root account")
        return _account("uid", int(sudo_uid), int(environ.get("SUDO_GID", "") or -1))
    if spec.startswith("agent:"):
        name = spec[len("agent:"):]
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise PolicyError("--as", f"no account named '{name}'",
                              f"create it with 'agentcell agent new {name}'") from None
        return _account("agent", pw.pw_uid, pw.pw_gid)
    if spec.isdigit():
        return _account("uid", int(spec), -1)
    raise PolicyError("--as", f"'{spec}' is not self, agent:NAME or a numeric uid", "e.g. --as agent:agent")


def _pw(uid: int) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        return None


def _account(mode: str, uid: int, gid: int) -> Identity:
    if uid == 0 or gid == 0:
        raise PolicyError("--as", "uid/gid 0 is root", "name a non-root account")
    pw = _pw(uid)
    if gid < 0:
        gid = pw.pw_gid if pw else uid
    name = pw.pw_name if pw else f"uid{uid}"
    groups = tuple(g for g in os.getgrouplist(pw.pw_name, gid) if g != 0) if pw else (gid,)
    return Identity(mode, uid, gid, name, _home_for(pw, name), groups)  # type: ignore[arg-type]


def build_env(environ: Mapping[str, str], ident: Identity, sets: Iterable[str] = (),
              keep: Iterable[str] = ()) -> tuple[tuple[str, str], ...]:
    """The scrubbed environment: PATH, LANG, LC_*, TERM, HOME, USER, then --keep-env and --env."""
    env: dict[str, str] = {"PATH": DEFAULT_PATH}
    for k, v in environ.items():
        if k in ("LANG", "TERM") or k.startswith("LC_"):
            env[k] = v
    env["HOME"] = ident.home
    env["USER"] = ident.user
    for name in keep:
        if not is_env_name(name):
            raise PolicyError("--keep-env", f"'{name}' is not a variable name", "e.g. --keep-env EDITOR")
        if name in environ:
            env[name] = environ[name]
    for kv in sets:
        k, eq, v = kv.partition("=")
        if not eq or not is_env_name(k):
            raise PolicyError("--env", f"'{kv}' is not NAME=VALUE", "e.g. --env DEBUG=1")
        env[k] = v
    return tuple(env.items())


def cell_cwd(host_cwd: str, visible: Iterable[str], home: str) -> str:
    """Keep the host's working directory when the cell can see it; else start in the cell's home."""
    for p in visible:
        if host_cwd == p or host_cwd.startswith(p.rstrip("/") + "/"):
            return host_cwd
    return home
