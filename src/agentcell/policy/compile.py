"""Compile a :class:`SessionPlan` into a :class:`SandboxPolicy`; load plans from TOML; explain policies.

Compiling has no side effects. The only I/O is path resolution (realpath, existence, the account
database). The plan is compiled by :func:`agentcell.policy.plan.compile_spec`, the compiler
``agentcell run``'s flags go through too, so the refusal rules — ``/``, a home dir itself, credential
stores, writable system dirs, missing paths — are the same ones. The same plan on the same host always
compiles to an equal policy.
"""
from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from ..cell.spec import SCRATCH_PATH, SYSTEM_RO_PATHS
from ..errors import PolicyError
from .models import IdentityModel, Limits, SandboxPolicy, SessionPlan
from .plan import PLAN, Plan, anchor, compile_spec

FIREWALL_RULES: dict[str, str] = {
    "none": "none: no network interfaces",
    "loopback": "loopback only",
    "proxy": "egress through the agentcell proxy only (domain allow-list); deny all else",
    "host-firewall": "egress: host nftables rules on the agent's uid; deny all else",
}


def compile_plan(plan: SessionPlan, *, environ: Mapping[str, str], euid: int | None = None,
                 host_cwd: str | None = None) -> SandboxPolicy:
    """Resolve and check everything ``plan`` asks for; refuse with a :class:`PolicyError` naming the key.

    ``environ`` and ``euid`` describe the invoking user (``euid`` defaults to the process's).
    ``host_cwd`` is where the session was started: it anchors relative paths and becomes the cell's
    working directory when the cell can see it. Without it, relative paths are refused and the cell
    starts in the first declared path (else the first ro path, else its home).
    """
    spec = compile_spec(plain(plan), environ=environ, euid=euid, host_cwd=host_cwd)
    extra = tuple(p for p in (spec.scratch_dir, spec.home_dir) if p)
    return SandboxPolicy(
        os_user=spec.identity.user,
        read_paths=spec.ro_paths + tuple(p for p in SYSTEM_RO_PATHS if os.path.lexists(p)),
        write_paths=spec.rw_paths + extra,
        env_allowlist=tuple(sorted(k for k, _ in spec.env)),
        firewall_rule=FIREWALL_RULES[plan.network],
        session_id=plan.session_id,
        ro_paths=spec.ro_paths,
        rw_paths=spec.rw_paths,
        masked_paths=spec.masked_paths,
        scratch_dir=spec.scratch_dir,
        home_dir=spec.home_dir,
        network=plan.network,
        limits=plan.limits,
        identity=IdentityModel.from_identity(spec.identity),
        env=spec.env,
        cwd=spec.cwd or spec.identity.home,
        wall_clock_limit_s=plan.wall_clock_limit_s,
        landlock=plan.landlock,
        landlock_min_abi=spec.landlock_min_abi,
        allow_write=spec.allow_write,
        egress=spec.egress,
    )


def plain(plan: SessionPlan) -> Plan:
    """The session plan as the plain plan the compiler takes (in the plan's own terms)."""
    lim = plan.limits
    return Plan(identity=plan.identity, declared_paths=plan.declared_paths, ro_paths=plan.ro_paths,
                masked_paths=plan.masked_paths, excluded_paths=plan.excluded_paths, scratch=plan.scratch,
                home=plan.home, home_persistent=plan.home_persistent, allow_unsafe_paths=plan.allow_unsafe_paths,
                env=[f"{k}={v}" for k, v in plan.env.items()], keep_env=plan.keep_env, allow_write=plan.allow_write,
                network=plan.network, allow_domains=plan.allow_domains, deny_domains=plan.deny_domains,
                allow_presets=plan.allow_presets, allow_ranges=plan.allow_ranges, resolver=plan.resolver,
                allow_egress=plan.allow_egress, allow_loopback=plan.allow_loopback, landlock=plan.landlock,
                landlock_min_abi=plan.landlock_min_abi, memory_max=lim.memory_bytes, cpu_percent=lim.cpu_percent,
                pids_max=lim.pids, cell_id=f"agentcell-{plan.session_id}", terms=PLAN)


def load_plan(path: str | os.PathLike[str]) -> SessionPlan:
    """Read a TOML policy file into a plan. Relative paths in it are taken relative to the file.

    Every failure is one :class:`PolicyError` line: for an invalid key or value, its field is the
    dotted location of the first error and its problem is pydantic's message.
    """
    from ..errors import AgentcellError
    from ..hostfs import read_regular

    where = os.fspath(path)
    try:
        data = tomllib.loads(read_regular(where, where, "give the path of a readable TOML file").decode("utf-8"))
    except AgentcellError as e:
        raise PolicyError(e.field, e.problem, e.fix) from None
    except ValueError as e:  # TOMLDecodeError, or bytes that are not UTF-8
        raise PolicyError(where, f"not valid TOML: {e}".splitlines()[0], "fix the syntax") from None
    except RecursionError:  # arrays or tables nested thousands deep: the parser's stack
        raise PolicyError(where, "not valid TOML: nested too deep", "fix the syntax") from None
    try:
        plan = SessionPlan.model_validate(data)
    except ValidationError as e:
        raise _first_error(e, where) from None
    base = os.path.dirname(os.path.abspath(where))

    def anchored(paths: list[str]) -> list[str]:
        return [anchor(p, base, "") for p in paths]

    return plan.model_copy(update={
        "declared_paths": anchored(plan.declared_paths),
        "excluded_paths": anchored(plan.excluded_paths),
        "ro_paths": anchored(plan.ro_paths),
        "masked_paths": anchored(plan.masked_paths),
        "scratch": anchor(plan.scratch, base, "") if plan.scratch else plan.scratch,
        "home": anchor(plan.home, base, "") if plan.home else plan.home,
    })


def _first_error(e: ValidationError, where: str) -> PolicyError:
    errors = e.errors()
    first = errors[0]
    loc = first["loc"]
    fix = f"correct it in {where}"
    if first["type"] == "extra_forbidden":
        model: type[BaseModel] = Limits if loc[:1] == ("limits",) and len(loc) > 1 else SessionPlan
        fix = f"check the spelling; valid keys: {', '.join(model.model_fields)}; {fix}"
    if len(errors) > 1:
        fix += f" ({len(errors) - 1} more error(s) after this one)"
    field = ".".join(str(part) for part in loc) or where
    return PolicyError(field, " ".join(first["msg"].split()), fix)


def explain(policy: SandboxPolicy) -> str:
    """A readable, multi-line account of what the cell gets. Environment values are not shown."""
    ident = policy.identity
    lim = policy.limits
    limits = [f"{k}={v}" for k, v in (("memory_bytes", lim.memory_bytes), ("cpu_percent", lim.cpu_percent),
                                       ("pids", lim.pids)) if v is not None]
    rows: list[tuple[str, Any]] = [
        ("session", policy.session_id),
        ("identity", f"{ident.user} (mode {ident.mode}, uid {ident.uid}, gid {ident.gid})"),
        ("groups", " ".join(map(str, ident.groups)) or "none"),
        ("network", f"{policy.network} ({policy.firewall_rule})"),
        ("rw", policy.rw_paths),
        ("ro", policy.ro_paths),
        ("masked", policy.masked_paths),
        ("scratch", f"{policy.scratch_dir or 'private tmpfs'} at {SCRATCH_PATH}"),
        ("home", f"{policy.home_dir or 'private tmpfs'} at {ident.home}"),
        ("read", policy.read_paths),
        ("write", policy.write_paths),
        ("env", " ".join(policy.env_allowlist)),
        ("cwd", policy.cwd),
        ("limits", " ".join(limits) or "none"),
        ("wall clock", f"{policy.wall_clock_limit_s} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines: list[str] = []
    for key, value in rows:
        values = list(value) if isinstance(value, tuple) else [value]
        lines.append(f"{key:>{width}}: {values[0] if values else '-'}")
        lines += [f"{'':>{width}}  {v}" for v in values[1:]]
    return "\n".join(lines) + "\n"
