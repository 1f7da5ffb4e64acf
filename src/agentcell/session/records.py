"""The typed parts of a session's checkpointed state, as frozen records.

The checkpoint stores each as a tagged mapping of plain data (:func:`to_plain`, :func:`from_plain`), not
as a class to import: any process reads it back (``session show``, ``recover``), and what the database
holds names no code to run. A checkpoint written before these records holds the mapping alone:
``of`` reads either.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

R = TypeVar("R")
TAG = "\0agentcell-record"  # no key agentcell records starts with a NUL


def of(cls: type[R], value: Any) -> R | None:
    """``value`` as a ``cls``: the record itself, or its fields as a mapping (an older checkpoint)."""
    if value is None or isinstance(value, cls):
        return value
    return cls(**{k: v for k, v in dict(value).items() if k != TAG})


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


RECORDS: dict[str, type[Any]] = {c.__name__: c for c in (Supervisor, Account, Grant, Surface)}


def to_plain(obj: Any) -> dict[str, Any]:
    """A record as its tagged mapping (fields in their order)."""
    return {TAG: type(obj).__name__, **{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}}


def from_plain(data: dict[str, Any]) -> Any:
    """The record a tagged mapping holds (its sequences as tuples); the mapping as it is when it names
    no record or does not fit one, for :func:`~.state.check_recorded` to refuse."""
    cls = RECORDS.get(str(data.get(TAG)))
    if cls is None:
        return data
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k != TAG}
    try:
        return cls(**fields)
    except TypeError:
        return data


def plain(value: Any) -> Any:
    """A state's value with its records as untagged mappings: as ``session show`` and the summary print it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
