"""What a session carries from node to node (checkpointed), what only its supervisor holds (not), and
where sessions are kept.

The state is plain data, frozen records and the configuration, plan and policy (:mod:`.records`, stored
as tagged plain data): LangGraph's SQLite checkpointer stores it after every node, and ``agentcell session
recover`` must be able to read it in another process and finish the teardown from it alone. Secret values
never enter it (the checkpoint database would keep them): the policy's environment holds a placeholder
for each, filled in at spawn from :class:`Runtime`. Live handles — the running cell, the firewall's log
reader — live in :class:`Runtime`, in the supervisor's memory only.
"""
from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypedDict

from .. import hostfs
from ..policy.models import SandboxPolicy, SessionPlan
from .config import SessionConfig
from .records import (
    TAG,
    Account,
    Escape,
    Grant,
    Launch,
    Result,
    Supervisor,
    Surface,
    from_plain,
    of,
    plain,
    stored,
    to_plain,
)

if TYPE_CHECKING:
    from ..host.base import CellHandle, CellHost

Status = Literal["running", "completed", "terminated", "aborted"]
FINAL: tuple[str, ...] = ("completed", "terminated", "aborted")
FAULTS_ENV = "AGENTCELL_TEST_FAULTS"  # the fault-injection hook (tests): "preflight=2,account=1,audit@spawn=1"
MAX_EVENTS = 100  # the monitor's events a session keeps


def add_events(kept: list[dict[str, Any]], more: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events reducer: a node's events join those kept, up to :data:`MAX_EVENTS`."""
    return [*kept, *more][:MAX_EVENTS]


class SessionState(TypedDict, total=False):
    session_id: str
    config: SessionConfig  # its secrets by name only (records.SECRET_PLACEHOLDER values)
    argv: list[str]  # what the cell runs
    launch: Launch  # the harness's launch: env, path, files, api_host
    seed_notes: list[str]  # what --home-from left out
    supervisor: Supervisor  # the process running the graph
    plan: SessionPlan
    policy: SandboxPolicy  # secret values replaced by records.SECRET_PLACEHOLDER
    backup_id: str | None
    account: Account | None
    human: list[int] | None  # uid, gid: who gets what the agent made in the declared paths
    grants: list[Grant]  # ACL grants made for this session
    firewall_table: str | None
    cell_id: str
    cache_dir: str | None  # the project's toolchain caches behind /cache (agentcell.caches)
    workspace_dir: str | None  # --workspace copy: the change set's store entry (agentcell.workspace)
    protect: Surface | None  # the control surface of the declared paths before the cell (protect/surface.py)
    harness_pid: int | None
    started_at: float
    deadline: float  # wall-clock time (time.time()) at which the session ends, reason timeout
    escape: Escape | None  # the first attempt that terminated the session
    events: Annotated[list[dict[str, Any]], add_events]  # what the monitor saw (CellEvent as data)
    result: Result | None  # the cell's result (exit status, signal, duration, events)
    status: Status
    reason: str
    config_marks: dict[str, str | None]  # .env / agentcell.toml inside a declared path: SHA-256 (None: absent)
    root_ids: list[list[int]]  # device and inode of the project and each declared path: what an agent could write
    problems: list[str]  # what teardown could not undo
    warnings: list[str]  # what the human should look at (config files the agent created)
    audit_error: str
    ended_at: float
    finished: bool  # the audit node ran: nothing left to recover
    recovered: bool  # finished by session recover: its run's end is not known (cleanup moves only the agent's)


@dataclass
class Runtime:
    """The supervisor's process-local side of running sessions."""

    stdio: tuple[int, int, int] = (0, 1, 2)
    faults: dict[str, int] = field(default_factory=dict)  # point -> failures still to inject
    secrets: dict[str, str] = field(default_factory=dict)
    # The keys the proxy injects (network.credentials.CredentialSet), and the CA their hosts are verified
    # against (None: the host's trust store): in memory only, never checkpointed.
    credentials: Any = None
    upstream_ca: str | None = None
    environ: dict[str, str] = field(default_factory=dict)  # the invoking user's (LANG, TERM, SUDO_UID)
    cells: dict[str, CellHandle] = field(default_factory=dict)
    host: CellHost | None = None  # where cells start (None: a cell host of their own, host.remote.RemoteHost)
    firewalls: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # session -> (HostFirewall, log)
    # session -> the files whose ACL its grant wrote, stat before and after (nodes.account.Changes): cleanup
    # re-keys the backup store's cache through the grant and the revoke at once
    granted: dict[str, Any] = field(default_factory=dict)
    stop_requested: dict[str, str] = field(default_factory=dict)  # session -> why
    status_line: bool = False
    # One monitor step (one checkpoint) per tick: every tick is a row in the checkpoint database, so
    # not every second (a second per tick grew it ~50 MB an hour). The status line still updates each second.
    tick_s: float = 15.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fault(self, point: str) -> bool:
        """Whether to inject a failure at ``point`` now (counts down)."""
        with self.lock:
            left = self.faults.get(point, 0)
            if left > 0:
                self.faults[point] = left - 1
                return True
        return False


def config_of(state: SessionState) -> SessionConfig:
    """The session's configuration (an older checkpoint's mapping read as one; none: the defaults)."""
    return of(SessionConfig, state.get("config")) or SessionConfig()


def plan_of(state: SessionState) -> SessionPlan | None:
    return of(SessionPlan, state.get("plan"))


def policy_of(state: SessionState) -> SandboxPolicy | None:
    """The session's policy, once its policy node has run."""
    return of(SandboxPolicy, state.get("policy"))


def parse_faults(text: str) -> dict[str, int]:
    from ..errors import PolicyError

    out: dict[str, int] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        point, _, n = item.partition("=")
        if not n.isdigit():
            raise PolicyError(FAULTS_ENV, f"'{item}' is not POINT=COUNT", "e.g. preflight=2,audit@spawn=1")
        out[point] = int(n)
    return out


_TAG = "\0agentcell-bytes:"  # no text agentcell records starts with a NUL


def _to_text(obj: Any) -> Any:
    """Strings that are not UTF-8 (a file name's bytes, decoded with surrogateescape) made storable,
    reversibly: the checkpoint's encoder refuses them, and a path must come back exactly as it was. The
    records go as their tagged mappings."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return _TAG + obj.encode("utf-8", "surrogateescape").hex()
    if stored(obj):
        obj = to_plain(obj)
    if isinstance(obj, dict):
        return {_to_text(k): _to_text(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_text(v) for v in obj)
    return obj


def _from_text(obj: Any) -> Any:
    if isinstance(obj, str):
        return bytes.fromhex(obj[len(_TAG):]).decode("utf-8", "surrogateescape") if obj.startswith(_TAG) else obj
    if isinstance(obj, dict):
        out = {_from_text(k): _from_text(v) for k, v in obj.items()}
        return from_plain(out) if TAG in out else out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_text(v) for v in obj)
    return obj


class Serde:
    """LangGraph's serializer, with the strings that are not UTF-8 carried through (:func:`_to_text`).
    Strict: what it reads back constructs no class but LangGraph's few safe types (dates, sets, paths:
    ``allowed_msgpack_modules=None``), none by name from the database; by default it would import and call
    whatever a checkpoint names. Our records go in as tagged plain data (:mod:`.records`)."""

    def __init__(self) -> None:
        from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

        self.inner = JsonPlusSerializer(allowed_msgpack_modules=None, allowed_json_modules=None)

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        return self.inner.dumps_typed(_to_text(obj))

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        return _from_text(self.inner.loads_typed(data))


def sessions_dir() -> str:
    from ..hostfs import state_dir

    return os.path.join(state_dir(), "sessions")


def connect() -> sqlite3.Connection:
    """The checkpoint database (root's, 0600 in a 0700 directory: it names accounts and paths)."""
    d = sessions_dir()
    os.makedirs(d, mode=0o700, exist_ok=True)
    path = os.path.join(d, "checkpoints.sqlite")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    # A fresh database is turned to WAL by its first connection. Sessions started at once (a fleet node's,
    # a batch of `session start`) each tried, and one would fail at once with "database is locked":
    # SQLite's busy timeout does not cover that change. One connection at a time does it, under a lock
    # (flock: let go if its holder dies); once the file is WAL (it stays so) the others only look.
    lock = os.open(os.path.join(d, "checkpoints.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = sqlite3.connect(path, check_same_thread=False, timeout=30)
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
        except BaseException:
            conn.close()
            raise
    finally:
        os.close(lock)
    return conn


def start_time(pid: int) -> int:
    """The process's start time in clock ticks (0 if gone): with the pid, it names one process."""
    try:
        return hostfs.start_time(pid)
    except (OSError, ValueError, IndexError):
        return 0


def supervisor_alive(state: SessionState) -> bool:
    try:
        sup = of(Supervisor, state.get("supervisor"))
        return sup is not None and int(sup.pid) > 0 and start_time(int(sup.pid)) == int(sup.start)
    except (TypeError, ValueError, AttributeError, OverflowError):  # not one agentcell recorded: none of ours
        return False


def check_recorded(state: SessionState, thread: str) -> None:
    """A session read back from the checkpoint database under the id ``thread``, before anything acts on it
    (recover, stop, restore): every name root will act on must be one agentcell made for this very session
    (its id that one, its cell and table named after it). The database is root's, but it is no place to
    take an account name or a path from on trust."""
    from ..accounts import ephemeral
    from ..errors import AgentcellError
    from ..network.firewall import table_name

    sid = str(state.get("session_id", ""))
    if not sid or not all(c.isalnum() or c in "-_" for c in sid) or len(sid) > 64:
        raise AgentcellError("session", f"recorded session id {sid[:70]!r} is malformed", "nothing was done")

    def bad(what: str, value: object) -> AgentcellError:
        return AgentcellError("session", f"session {thread}: recorded {what} {str(value)[:70]!r} is not one "
                              "agentcell makes for it", "nothing was done; the checkpoint database may have been "
                              "tampered with")

    if sid != thread:
        raise bad("session id", sid)
    cell = state.get("cell_id")
    if cell and cell != f"agentcell-{sid}":
        raise bad("cell", cell)
    table = state.get("firewall_table")
    if table and table != table_name(f"agentcell-{sid}"):
        raise bad("firewall table", table)
    human = state.get("human")
    if human is not None and not (isinstance(human, (list, tuple)) and len(human) == 2
                                  and all(type(x) is int and x >= 0 for x in human)):
        raise bad("human", human)
    cfg = config_of(state)
    cache = state.get("cache_dir")
    if cache:
        from ..caches import tree_of

        if cache != tree_of(cfg.project_root, cfg.agent):
            raise bad("cache", cache)
    account = plain(state.get("account"))  # (a record, or the mapping an older checkpoint holds)
    if isinstance(account, dict):
        if account.get("kind") == "ephemeral":
            uid = account.get("uid")
            if account.get("name") != ephemeral.name_for(sid) or not isinstance(uid, int) or \
                    not ephemeral.UID_FIRST <= uid <= ephemeral.UID_LAST or account.get("gid") != uid:
                raise bad("account", account.get("name"))
        elif account.get("kind") == "agent":
            from ..accounts.registry import open_registry

            if account.get("name") != cfg.agent:  # (the session's own agent, none other)
                raise bad("agent", account.get("name"))
            try:
                with open_registry() as reg:
                    rec = reg.get(str(account.get("name")))
            except Exception:  # noqa: BLE001 - no such agent, or no registry: either way not ours
                raise bad("agent", account.get("name")) from None
            if getattr(rec, "uid", None) != account.get("uid") or getattr(rec, "gid", None) != account.get("gid"):
                raise bad("agent", account.get("name"))
        else:
            raise bad("account", account)
    elif account is not None:
        raise bad("account", account)
