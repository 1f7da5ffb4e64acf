"""Compile a :class:`SessionPlan` into a :class:`SandboxPolicy`; load plans from TOML; explain policies.

Compiling has no side effects. The only I/O is path resolution (realpath, existence, the account
database), done by :mod:`agentcell.policy.resolve` so that the refusal rules — ``/``, a home dir
itself, credential stores, writable system dirs, missing paths — are the same ones ``agentcell run``
applies. The same plan on the same host always compiles to an equal policy.
"""
from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ValidationError

from ..cell.spec import SCRATCH_PATH, SYSTEM_RO_PATHS, Identity
from ..errors import PolicyError
from . import resolve as rs
from .models import IdentityModel, Limits, SandboxPolicy, SessionPlan

FIREWALL_RULES: dict[str, str] = {
    "none": "none: no network interfaces",
    "loopback": "loopback only",
    "proxy": "egress through the agentcell proxy only (domain allow-list); deny all else",
    "host-firewall": "egress: host nftables rules on the agent's uid; deny all else",
}

# resolve.py speaks in CLI flags; a plan speaks in its own keys.
_FIELD_FOR_FLAG = {"--as": "identity", "--env": "env", "--keep-env": "keep_env"}
_WORDS_FOR_FLAG = (
    (rs.UNSAFE_FLAG, "allow_unsafe_paths = true"),
    ("--as ", "identity = "),
    ("--keep-env ", "keep_env = "),
    ("--env ", "env "),
)


@contextmanager
def _in_plan_terms() -> Iterator[None]:
    try:
        yield
    except PolicyError as e:
        problem, fix = e.problem, e.fix
        for flag, key in _WORDS_FOR_FLAG:
            problem, fix = problem.replace(flag, key), fix.replace(flag, key)
        raise PolicyError(_FIELD_FOR_FLAG.get(e.field, e.field), problem, fix) from None


def _allowed_writes(paths: Iterable[str], rw: tuple[str, ...], host_cwd: str | None) -> tuple[str, ...]:
    """Protected paths the plan lets the command write (relative ones from where the session started)."""
    given = [p if os.path.isabs(p) or host_cwd is None else os.path.join(host_cwd, p) for p in paths]
    return rs.allowed_writes(given, rw, field="allow_write", fix="declare its project")


def compile_plan(plan: SessionPlan, *, environ: Mapping[str, str], euid: int | None = None,
                 host_cwd: str | None = None) -> SandboxPolicy:
    """Resolve and check everything ``plan`` asks for; refuse with a :class:`PolicyError` naming the key.

    ``environ`` and ``euid`` describe the invoking user (``euid`` defaults to the process's).
    ``host_cwd`` is where the session was started: it anchors relative paths and becomes the cell's
    working directory when the cell can see it. Without it, relative paths are refused and the cell
    starts in the first declared path (else the first ro path, else its home).
    """
    with _in_plan_terms():
        ident = rs.resolve_identity(plan.identity, euid=euid, environ=environ)
    if plan.network == "host-firewall" and ident.userns:
        raise PolicyError("network", "host-firewall rules key on an account's uid; identity 'self' has none",
                          "use identity = agent:NAME, or network = proxy")

    homes = rs.home_dirs()
    unsafe = plan.allow_unsafe_paths

    def paths(key: str, given: Iterable[str], *, writable: bool, allow_unsafe: bool) -> tuple[str, ...]:
        absolute = [_anchor(p, host_cwd, key) for p in given]
        with _in_plan_terms():
            return rs.resolve_paths(absolute, field=key, writable=writable, allow_unsafe=allow_unsafe,
                                    homes=homes)

    rw = paths("declared_paths", plan.declared_paths, writable=True, allow_unsafe=unsafe)
    ro = paths("ro_paths", plan.ro_paths, writable=False, allow_unsafe=unsafe)
    # Hiding a path never opens the host, so masks need no override (as with `agentcell run --mask`).
    masked = paths("masked_paths", plan.masked_paths, writable=False, allow_unsafe=True)
    rs.check_masks(masked, "masked_paths")
    excluded = paths("excluded_paths", plan.excluded_paths, writable=False, allow_unsafe=True)
    for p in excluded:
        if p in rw:
            raise PolicyError("excluded_paths", f"{p} is itself a declared path",
                              "remove it from declared_paths instead")
        if not any(p.startswith(d.rstrip("/") + "/") for d in rw):
            raise PolicyError("excluded_paths", f"{p} is not inside any declared path",
                              "exclude paths inside declared_paths; hide others with masked_paths")
    masked += tuple(p for p in excluded if p not in masked)
    scratch = paths("scratch", [plan.scratch], writable=True, allow_unsafe=unsafe) if plan.scratch else ()
    home = paths("home", [plan.home], writable=True, allow_unsafe=unsafe) if plan.home else ()
    if plan.home_persistent:
        home = (_own_home(ident),)
    rs.check_disjoint({"declared_paths": rw, "ro_paths": ro, "masked_paths": masked, "scratch": scratch,
                       "home": home})

    with _in_plan_terms():
        env = rs.build_env(environ, ident, sets=[f"{k}={v}" for k, v in plan.env.items()], keep=plan.keep_env)
    if host_cwd is not None:
        cwd = rs.cell_cwd(os.path.realpath(host_cwd), (*rw, *ro), ident.home)
    else:
        cwd = (*rw, *ro, ident.home)[0]

    return SandboxPolicy(
        os_user=ident.user,
        read_paths=ro + tuple(p for p in SYSTEM_RO_PATHS if os.path.lexists(p)),
        write_paths=rw + scratch + home,
        env_allowlist=tuple(sorted(k for k, _ in env)),
        firewall_rule=FIREWALL_RULES[plan.network],
        session_id=plan.session_id,
        ro_paths=ro,
        rw_paths=rw,
        masked_paths=masked,
        scratch_dir=scratch[0] if scratch else None,
        home_dir=home[0] if home else None,
        network=plan.network,
        limits=plan.limits,
        identity=IdentityModel.from_identity(ident),
        env=env,
        cwd=cwd,
        wall_clock_limit_s=plan.wall_clock_limit_s,
        landlock=plan.landlock,
        # host-firewall keeps the host's network: Landlock's abstract-socket scope (ABI 6) is needed.
        landlock_min_abi=max(plan.landlock_min_abi, 6) if plan.network == "host-firewall" else plan.landlock_min_abi,
        allow_write=_allowed_writes(plan.allow_write, rw, host_cwd),
        egress=_egress(plan),
    )


def _own_home(ident: Identity) -> str:
    """A persistent agent's own home: the account's, and only the account's to write."""
    import stat

    if ident.mode != "agent":
        raise PolicyError("home_persistent", "only an agent account (identity agent:NAME) has a home of its own "
                          "to keep", "leave it out")
    try:
        st = os.lstat(ident.home)
    except OSError:
        raise PolicyError("home_persistent", f"{ident.home} (the home of {ident.user}) is missing",
                          f"see 'agentcell agent info {ident.user}'") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != ident.uid:
        raise PolicyError("home_persistent", f"{ident.home} is not a directory of {ident.user}'s",
                          f"see 'agentcell agent info {ident.user}'")
    return ident.home


def _egress(plan: SessionPlan) -> tuple[str, ...]:
    from ..network import compile as nc

    return nc.egress(plan.network, allow_domains=plan.allow_domains, deny_domains=plan.deny_domains,
                     allow_presets=plan.allow_presets, allow_ranges=plan.allow_ranges, resolver=plan.resolver,
                     allow_egress=plan.allow_egress, allow_loopback=plan.allow_loopback, names=nc.PLAN)


def _anchor(path: str, base: str | None, key: str) -> str:
    if not path or os.path.isabs(path) or path.startswith("~"):
        return path  # resolve_path refuses the empty path and expands ~
    if base is None:
        raise PolicyError(key, f"{path} is relative and there is no directory to anchor it",
                          "give an absolute path")
    return os.path.join(base, path)


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
        return [_anchor(p, base, "") for p in paths]

    return plan.model_copy(update={
        "declared_paths": anchored(plan.declared_paths),
        "excluded_paths": anchored(plan.excluded_paths),
        "ro_paths": anchored(plan.ro_paths),
        "masked_paths": anchored(plan.masked_paths),
        "scratch": _anchor(plan.scratch, base, "") if plan.scratch else plan.scratch,
        "home": _anchor(plan.home, base, "") if plan.home else plan.home,
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
