"""What ``session start`` was asked for, as one frozen record from the parser to the session: its
options (None: not given, so the environment, the .env, the project's agentcell.toml or the default
decides) and the harness's own arguments."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from typing import Any

from ..errors import AgentcellError


@dataclass(frozen=True)
class StartRequest:
    harness: str | None = None
    agent: str | None = None
    declared_paths: tuple[str, ...] | None = None
    project_root: str | None = None
    env_file: str | None = None
    wall_clock_limit_s: str | None = None
    backup_dir: str | None = None
    audit_log_path: str | None = None
    audit_witness: str | None = None
    audit_witness_required: bool = False
    firewall_enabled: str | None = None
    network: str | None = None
    allow_domains: tuple[str, ...] | None = None
    deny_domains: tuple[str, ...] | None = None
    allow_presets: tuple[str, ...] | None = None
    allow_ranges: tuple[str, ...] | None = None
    resolver: str | None = None
    api_base: str | None = None
    model: str | None = None
    upstream_ca: str | None = None
    secret: tuple[str, ...] | None = None
    secret_host: tuple[str, ...] | None = None
    env: tuple[str, ...] | None = None
    keep_env: tuple[str, ...] | None = None
    risk: str | None = None
    memory: str | None = None
    cpu: str | None = None
    pids: str | None = None
    limits: str | None = None
    home_from: str | None = None
    ceilings: str | None = None
    cache: str | None = None
    workspace: str | None = None
    workspace_include: tuple[str, ...] | None = None
    git_identity: str | None = None
    explain: bool = False
    json: bool = False
    summary_file: str | None = None
    session_id: str | None = None
    harness_args: tuple[str, ...] = ()

    @classmethod
    def of(cls, options: Any, harness_args: list[str]) -> StartRequest:
        """From the parser's namespace (a repeatable flag's list becomes a tuple)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name != "harness_args":
                v = getattr(options, f.name)
                values[f.name] = tuple(v) if isinstance(v, list) else v
        return cls(**values,
                   harness_args=tuple(harness_args))

    def flags(self) -> dict[str, Any]:
        """The options the session's configuration takes (:func:`.config.load`), as the parser gave them."""
        from .config import EGRESS_KEYS

        keys = ("harness", "agent", "declared_paths", "project_root", "wall_clock_limit_s", "backup_dir",
                "audit_log_path", "audit_witness", "audit_witness_required", "firewall_enabled", "network",
                *EGRESS_KEYS, "resolver", "api_base", "model", "env",
                "keep_env", "risk", "memory", "cpu", "pids", "limits", "home_from", "git_identity", "ceilings",
                "cache", "workspace", "workspace_include", "harness_args")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(self, k)) for k in keys)}


def new_session_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + os.urandom(3).hex()


def checked_id(sid: str, field: str = "ID") -> str:
    from ..hostfs import shown

    if not sid or len(sid) > 64 or not all(c.isascii() and (c.isalnum() or c in "-_") for c in sid):
        fix = "1-64 of letters, digits, '-' and '_'" if field != "ID" else "see 'agentcell session list'"
        raise AgentcellError(field, f"'{shown(sid, 80)}' is not a session id", fix)
    return sid
