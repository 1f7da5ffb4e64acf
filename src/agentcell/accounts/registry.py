"""The record of agent accounts: a root-owned TOML file in the state dir, written before anything is made.

``/var/lib/agentcell/agents.toml`` (``$AGENTCELL_STATE_DIR`` overrides the directory, for tests and
for hosts that keep state elsewhere) holds one table per agent::

    [agents.claude]
    state = "ready"            # creating -> ready -> deleting; a crash leaves the step it was in
    uid = 1001
    gid = 1002
    group = "agentcell-claude"
    home = "/home/claude"
    human = "alice"
    created = "2026-11-30T13:20:00+00:00"

    [[agents.claude.shares]]
    source = "/home/alice/src/app"
    mode = "rw"                # rw | ro
    dev = 2049                 # identity of the source when shared: a replaced path is refused at run
    ino = 1234567
    prior_acl = []             # entries (relative paths) that had an ACL of their own before the share

The record is written before the account exists (state ``creating``), so ``agent delete`` can always
clean a half-made agent; it is the only thing agentcell trusts about which accounts are its own.
Readers and writers take an exclusive lock on ``agents.lock`` (``agent run`` a shared one while it
resolves its shares, so no share changes under a starting cell).

The records are plain classes, not pydantic models: ``agent run`` reads them on every command and
pydantic's import costs ~70 ms here; for the same reason each save also writes ``agents.cache``, the
parsed file in marshal form keyed by the TOML's (inode, size, mtime), which a reader uses instead of
tomllib (~10 ms with the ``re`` it imports) while the key matches — a hand edit of the TOML does not
match and is parsed. Every field is checked on load; a damaged file is an error that names the
field, never a traceback.
"""
from __future__ import annotations

import fcntl
import marshal
import os

from .. import hostfs
from ..errors import AgentcellError
from ..hostfs import state_dir

GROUP_PREFIX = "agentcell-"
STATES = ("creating", "ready", "deleting")
MODES = ("rw", "ro")



class RegistryError(AgentcellError):
    pass


class Share:
    __slots__ = ("source", "mode", "dev", "ino", "prior_acl")

    def __init__(self, source: str, mode: str, dev: int, ino: int, prior_acl: list[str] | None = None) -> None:
        self.source, self.mode, self.dev, self.ino = source, mode, dev, ino
        self.prior_acl = list(prior_acl or [])

    def as_dict(self) -> dict[str, object]:
        return {"source": self.source, "mode": self.mode, "dev": self.dev, "ino": self.ino,
                "prior_acl": self.prior_acl}


class AgentRecord:
    __slots__ = ("name", "state", "uid", "gid", "group", "home", "human", "created", "shares")

    def __init__(self, name: str, *, state: str = "creating", uid: int = -1, gid: int = -1, group: str = "",
                 home: str = "", human: str = "", created: str = "", shares: list[Share] | None = None) -> None:
        self.name, self.state, self.uid, self.gid = name, state, uid, gid
        self.group = group or GROUP_PREFIX + name
        self.home, self.human, self.created = home, human, created
        self.shares = list(shares or [])

    def as_dict(self) -> dict[str, object]:
        return {"state": self.state, "uid": self.uid, "gid": self.gid, "group": self.group, "home": self.home,
                "human": self.human, "created": self.created, "shares": [s.as_dict() for s in self.shares]}

    def share_for(self, path: str) -> Share | None:
        return next((s for s in self.shares if s.source == path), None)


def _bad(where: str, problem: str) -> RegistryError:
    return RegistryError(where, problem, "the file is written by agentcell only: restore it or remove the entry")


def _str(table: dict[str, object], key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str):
        raise _bad(where, f"'{key}' is missing or not a string")
    return value


def _int(table: dict[str, object], key: str, where: str) -> int:
    value = table.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(where, f"'{key}' is missing or not an integer")
    return value


def _load_record(name: str, table: object, path: str) -> AgentRecord:
    where = f"{path} [agents.{name}]"
    if not isinstance(table, dict):
        raise _bad(where, "is not a table")
    state = _str(table, "state", where)
    if state not in STATES:
        raise _bad(where, f"unknown state '{state}'")
    raw_shares = table.get("shares", [])
    if not isinstance(raw_shares, list):
        raise _bad(where, "'shares' is not a list")
    shares = []
    for i, raw in enumerate(raw_shares):
        w = f"{where} shares[{i}]"
        if not isinstance(raw, dict):
            raise _bad(w, "is not a table")
        mode = _str(raw, "mode", w)
        if mode not in MODES:
            raise _bad(w, f"unknown mode '{mode}'")
        prior = raw.get("prior_acl", [])
        if not isinstance(prior, list) or not all(isinstance(p, str) for p in prior):
            raise _bad(w, "'prior_acl' is not a list of paths")
        shares.append(Share(_str(raw, "source", w), mode, _int(raw, "dev", w), _int(raw, "ino", w), prior))
    return AgentRecord(name, state=state, uid=_int(table, "uid", where), gid=_int(table, "gid", where),
                       group=_str(table, "group", where), home=_str(table, "home", where),
                       human=_str(table, "human", where), created=_str(table, "created", where), shares=shares)


def check_share(rec: AgentRecord, share: Share) -> str:
    """Why the share cannot be used as recorded ('' when it can): it must still resolve, without a
    symlink nobody but root could have made, to the very file it was when shared."""
    from ..policy import resolve as rs

    try:
        real = rs.resolve_path(share.source, field="share", writable=share.mode == "rw")
    except AgentcellError as e:
        return e.problem
    if real != share.source:
        return f"{share.source} now resolves to {real}"
    st = os.lstat(real)
    if (st.st_dev, st.st_ino) != (share.dev, share.ino):
        return f"{share.source} was replaced since it was shared (another file is there now)"
    return ""


class Registry:
    """The agents file, opened under its lock. Use :func:`open_registry`. ``last_uid``: the highest
    uid ever given to an agent (never handed out again)."""

    def __init__(self, path: str, agents: dict[str, AgentRecord], writable: bool, last_uid: int = 0) -> None:
        self.path, self.agents, self.writable, self.last_uid = path, agents, writable, last_uid

    def get(self, name: str) -> AgentRecord:
        rec = self.agents.get(name)
        if rec is None:
            raise RegistryError("agent", f"no agent named '{name}' in {self.path}",
                                "see 'agentcell agent list'; create one with 'agentcell agent new'")
        return rec

    def save(self) -> None:
        """Write atomically (a new file renamed over the old one, fsynced): a crash leaves the old or
        the new record, never half of one. Then the cache, keyed by the file just written."""
        import tomli_w

        assert self.writable, "save() needs open_registry(write=True)"
        data = {"last_uid": self.last_uid,
                "agents": {name: rec.as_dict() for name, rec in sorted(self.agents.items())}}
        _replace(self.path, tomli_w.dumps(data).encode())
        _replace(_cache(self.path), marshal.dumps((_key(self.path), data)))


def _cache(path: str) -> str:
    return path.removesuffix(".toml") + ".cache"


def _key(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _replace(path: str, content: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _read(path: str) -> dict[str, object]:
    try:
        key = _key(path)
    except FileNotFoundError:
        return {}
    try:
        with open(_cache(path), "rb") as f:
            cached_key, data = marshal.loads(f.read())
        if cached_key == key and isinstance(data, dict):
            return data
    except (OSError, ValueError, EOFError, TypeError):
        pass
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RegistryError(path, f"is not valid TOML ({e})", "restore it from a backup") from None


def _private_dir(d: str) -> None:
    """The state dir must be root's own: what it records decides whom agentcell deletes."""
    if os.geteuid() != 0:
        raise RegistryError("agents", "agent accounts are root's to make, list and delete", "run it through sudo")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except PermissionError:
        raise RegistryError("state dir", f"cannot create {d}", "agent accounts need root: run through sudo") from None
    if not hostfs.only_ours_at(d, {os.geteuid()}, directory=True):
        raise RegistryError("state dir", f"{d} must be a directory owned by root, not writable by others",
                            f"fix it: chown root: {d} && chmod 700 {d}")


class open_registry:  # noqa: N801 (a context manager used like a function; contextlib costs ~3 ms here)
    """``with open_registry(write=...) as reg``: the agents file under its lock (exclusive to write,
    shared to read)."""

    def __init__(self, *, write: bool = False) -> None:
        self.write = write
        self.lock = -1

    def __enter__(self) -> Registry:
        d = state_dir()
        _private_dir(d)
        path = os.path.join(d, "agents.toml")
        self.lock = os.open(os.path.join(d, "agents.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                            0o600)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX if self.write else fcntl.LOCK_SH)
            data = _read(path)
            table, last = data.get("agents", {}), data.get("last_uid", 0)
            if not isinstance(table, dict) or not isinstance(last, int):
                raise RegistryError(path, "'agents' is not a table or 'last_uid' not a number",
                                    "the file is written by agentcell only")
            agents = {name: _load_record(name, t, path) for name, t in table.items()}
        except BaseException:
            os.close(self.lock)
            raise
        return Registry(path, agents, self.write, max([last, *(r.uid for r in agents.values())]))

    def __exit__(self, *exc: object) -> None:
        os.close(self.lock)  # releases the lock
