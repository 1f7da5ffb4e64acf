"""The typed parts of a session's checkpointed state: frozen records, and the configuration, plan and
policy as their own classes.

The checkpoint stores each as a tagged mapping of plain data (:func:`to_plain`, :func:`from_plain`), not
as a class to import: any process reads it back (``session show``, ``recover``), and what the database
holds names no code to run. A checkpoint written before these records holds the mapping alone:
``of`` reads either.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from .config import SessionConfig

if TYPE_CHECKING:
    from pydantic import BaseModel

R = TypeVar("R")
TAG = "\0agentcell-record"  # no key agentcell records starts with a NUL
SECRET_PLACEHOLDER = "<secret: filled in at spawn>"
MODELS = ("SessionPlan", "SandboxPolicy")  # agentcell.policy.models': rebuilt by their model_validate


def of(cls: type[R], value: Any) -> R | None:
    """``value`` as a ``cls``: the record itself, or its fields as a mapping (an older checkpoint)."""
    if value is None or isinstance(value, cls):
        return value
    return record(cls, value)


def record(cls: type[R], data: Mapping[str, Any]) -> R:
    """The ``cls`` a mapping of its fields makes (tagged or not)."""
    if cls is Result:
        return Result.of(data)  # type: ignore[return-value]
    if cls is SessionConfig:
        return _config(data)  # type: ignore[return-value]
    if cls.__name__ in MODELS:
        return cls.model_validate({k: v for k, v in data.items() if k != TAG})  # type: ignore[attr-defined, no-any-return]
    return cls(**_fields(data))


def _model(name: str) -> type[BaseModel]:
    from ..policy import models

    cls: type[BaseModel] = getattr(models, name)
    return cls


def _config(data: Mapping[str, Any]) -> SessionConfig:
    """The configuration from its :meth:`~.config.SessionConfig.as_dict`: the secrets by their names, each
    value a placeholder (the values are the supervisor's, never checkpointed)."""
    fields = _fields(data)
    names = fields.pop("secret_names", ())
    fields["env"] = tuple(tuple(kv) for kv in fields.get("env", ()))
    return SessionConfig(**fields, secrets={n: SECRET_PLACEHOLDER for n in names})


def stored(obj: Any) -> bool:
    """Whether ``obj`` goes into the checkpoint as a tagged mapping (:func:`to_plain`)."""
    return type(obj) in RECORDS.values() or isinstance(obj, SessionConfig) or \
        (type(obj).__name__ in MODELS and type(obj) is _model(type(obj).__name__))


def _fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """A mapping's fields for a record's constructor: untagged, its sequences as tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k != TAG}


def _frozen(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(data or {}))


@dataclass(frozen=True)
class Supervisor:
    """The process running the graph."""

    pid: int
    start: int  # its start time in clock ticks: with the pid, it names one process


@dataclass(frozen=True)
class Account:
    """The account the agent runs as."""

    kind: str  # ephemeral (made for the session), agent (a persistent agent's), self (rootless: the user's)
    name: str
    uid: int
    gid: int
    group: str


@dataclass(frozen=True)
class Grant:
    """A declared path shared with the account by ACL for this session."""

    path: str
    prior: tuple[str, ...]  # the default ACLs the path had before (acl.prior_acl): revoke keeps them


@dataclass(frozen=True)
class Surface:
    """The control surface of the declared paths before the cell (:mod:`agentcell.protect`): what cleanup
    compares with what is there after."""

    before: dict[str, tuple[int, int, int, int]]  # path -> (type, inode, size, mtime)
    truncated: bool  # the scan stopped short
    since_ns: int  # what changed after this (wall clock, ns) was the session's
    meanings: dict[str, str] | None = None  # what each entry decides (protect.surface.meanings)
    env_files: tuple[str, ...] = ()  # the env files there: hidden in the cell


@dataclass(frozen=True)
class Launch:
    """The harness's launch as the session keeps it (:class:`agentcell.harness.profiles.Launch` but its
    argv, which the session keeps on its own)."""

    env: Mapping[str, str]  # what the profile sets
    path: str | None  # the cell's PATH
    interactive: bool
    api_host: str | None  # the model API's host:port
    files: tuple[Mapping[str, Any], ...]  # the seed directory's files: path, content, home, env

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", _frozen(self.env))
        object.__setattr__(self, "files", tuple(_frozen(f) for f in self.files))


@dataclass(frozen=True)
class Escape:
    """The first attempt that terminated the session (:class:`agentcell.policy.models.EscapeEvent`)."""

    session_id: str
    operation: str
    target: str  # the path, host:port, binary or resource that was reached for
    reason: str  # the rule that refused it, or why it counts as an escape
    pid: int | None
    exe: str | None
    source: str  # the monitor source that saw it
    ts: float
    ancestry: tuple[tuple[int, str, str], ...] = ()  # [pid, exe, command line] of its parents

    def __post_init__(self) -> None:
        object.__setattr__(self, "ancestry", tuple(tuple(a) for a in self.ancestry))


@dataclass(frozen=True)
class Result:
    """The cell's result as its host reported it. A host lost before the cell's end reports only the
    status it could not learn (None) and why: the fields it did not report are None, and absent from
    :meth:`as_plain` as they were from the report."""

    exit_status: int | None
    signal: int | None
    duration_s: float | None = None
    cell_id: str | None = None
    timed_out: bool | None = None
    error: str | None = None
    events: tuple[Mapping[str, Any], ...] | None = None  # None: not kept here (the state's events hold them)
    more: Mapping[str, Any] = field(default_factory=dict)  # what some cells report: egress_blocked, monitor_*, ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "more", _frozen(self.more))

    @classmethod
    def of(cls, report: Mapping[str, Any]) -> Result:
        """The record of a host's report (or an older checkpoint's mapping)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"more"}
        known = {k: v for k, v in report.items() if k in names}
        if known.get("events") is not None:
            known["events"] = tuple(known["events"])
        if TAG in report:  # the record's own mapping
            return cls(**known, more=report.get("more") or {})
        return cls(**known, more={k: v for k, v in report.items() if k not in names})

    def without_events(self) -> Result:
        return dataclasses.replace(self, events=None)

    def as_plain(self) -> dict[str, Any]:
        """The report's mapping again."""
        out: dict[str, Any] = {"exit_status": self.exit_status, "signal": self.signal}
        for name in ("duration_s", "cell_id", "timed_out"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out["error"] = self.error
        if self.events is not None:
            out["events"] = [plain(dict(e)) for e in self.events]
        return {**out, **plain(dict(self.more))}


RECORDS: dict[str, type[Any]] = {c.__name__: c for c in (Supervisor, Account, Grant, Surface, Launch, Escape,
                                                          Result)}


def to_plain(obj: Any) -> dict[str, Any]:
    """A record as its tagged mapping (fields in their order)."""
    if isinstance(obj, SessionConfig):
        return {TAG: "SessionConfig", **obj.as_dict()}
    if type(obj).__name__ in MODELS:
        return {TAG: type(obj).__name__, **obj.model_dump()}
    return {TAG: type(obj).__name__, **{f.name: _unfrozen(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}


def _unfrozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _unfrozen(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_unfrozen(v) for v in value)
    return value


def from_plain(data: dict[str, Any]) -> Any:
    """The record a tagged mapping holds (its sequences as tuples); the mapping as it is when it names
    no record or does not fit one, for :func:`~.state.check_recorded` to refuse."""
    name = str(data.get(TAG))
    cls = SessionConfig if name == "SessionConfig" else _model(name) if name in MODELS else RECORDS.get(name)
    if cls is None:
        return data
    try:
        return record(cls, data)
    except (TypeError, ValueError):  # (a model's ValidationError is a ValueError)
        return data


def plain(value: Any) -> Any:
    """A state's value with its records as untagged mappings: as ``session show`` and the summary print it."""
    if isinstance(value, Result):
        return value.as_plain()
    if isinstance(value, SessionConfig):
        return value.as_dict()
    if type(value).__name__ in MODELS:
        return value.model_dump()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value
