"""A session plan: one session as plain data, the unit of ``agentcell fleet`` and ``agentcell k8s``.

One JSON object per line of a plans file::

    {"name": "fix-1", "project": {"files": {"app.py": "print(1)\\n"}}, "harness": "scripted",
     "script": "edit app.py 1 2\\nrun python3 app.py", "wall_clock_s": 120}

A plan says what ``agentcell session start`` would be told; :meth:`SessionPlan.start_args` turns it into
those flags, so the session's own checks (harness, egress names, ceilings) still decide, on the node. What
this model checks is what must hold before anything is sent anywhere: the fields' names and types, a
name usable as a directory and as a Kubernetes name, one project source. Credentials are not part of a
plan: a plan travels through the cluster's object store.
"""
from __future__ import annotations

import ipaddress
import json
import posixpath
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import AgentcellError
from ..policy.models import Network, Risk

NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,34}[a-z0-9])?$")  # a directory, a DNS label, a Kubernetes name part
MAX_PLANS = 10_000
MAX_FILES_BYTES = 4 << 20  # inline project files: a small project, not a checkout


class Project(BaseModel):
    """Where the session's project comes from, on the node that runs it. Exactly one of:
    ``files`` (inline: relative path -> text), ``path`` (a directory on every node, copied), ``git``
    (a repository URL or path the node can clone, at ``ref``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    files: dict[str, str] | None = None
    path: str | None = None
    git: str | None = None
    ref: str | None = None

    @model_validator(mode="after")
    def _one(self) -> Project:
        given = [k for k in ("files", "path", "git") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of files, path or git")
        if self.ref is not None and self.git is None:
            raise ValueError("ref goes with git")
        if self.ref is not None and (self.ref.startswith("-") or not self.ref.strip()):
            raise ValueError("ref must name a branch, tag or commit (not start with -)")
        if self.path is not None and not posixpath.isabs(self.path):
            raise ValueError("path must be absolute (a directory on the node)")
        if self.files is not None:
            if sum(len(k) + len(v.encode(errors="replace")) for k, v in self.files.items()) > MAX_FILES_BYTES:
                raise ValueError(f"inline files exceed {MAX_FILES_BYTES >> 20} MiB; use path or git")
            for rel, text in self.files.items():
                try:
                    rel.encode(), text.encode()
                except UnicodeEncodeError:
                    raise ValueError(f"{rel!r} (or its text) is not valid Unicode") from None
                norm = posixpath.normpath(rel)
                if posixpath.isabs(rel) or norm == ".." or norm.startswith("../") or norm == "." or "\0" in rel:
                    raise ValueError(f"'{rel}' is not a relative path inside the project")
        return self


class SessionPlan(BaseModel):
    """One session. ``args`` are the harness's own arguments (after ``--``); ``script`` is the
    ``scripted`` harness's steps; ``prompt`` is the one prompt of a harness that takes one."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    project: Project
    harness: str = "shell"
    args: tuple[str, ...] = ()
    script: str | None = None
    prompt: str | None = None
    wall_clock_s: int | None = Field(default=None, gt=0, le=7 * 86400)
    risk: Risk | None = None
    memory: str | None = None
    cpu: int | None = Field(default=None, gt=0)
    pids: int | None = Field(default=None, gt=0)
    network: Network | None = None
    allow_domains: tuple[str, ...] = ()
    deny_domains: tuple[str, ...] = ()
    allow_presets: tuple[str, ...] = ()
    allow_ranges: tuple[str, ...] = ()
    resolver: str | None = None
    api_base: str | None = None
    model: str | None = None
    env: dict[str, str] = {}
    keep_env: tuple[str, ...] = ()  # names only: the values come from the node (fleet run --node-env-file)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError("1-36 of a-z, 0-9 and '-', starting and ending with a letter or digit")
        return v

    @field_validator("env", "keep_env")
    @classmethod
    def _env(cls, v: Any) -> Any:
        for k in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                raise ValueError(f"'{k}' is not a variable name")
        return v

    @model_validator(mode="after")
    def _harness_input(self) -> SessionPlan:
        given = [k for k in ("args", "script", "prompt") if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(f"give one of args, script or prompt, not {' and '.join(given)}")
        if self.script is not None and self.harness != "scripted":
            raise ValueError("script is the scripted harness's: set harness to scripted")
        return self

    def harness_args(self) -> list[str]:
        if self.script is not None:
            return ["--text", self.script]
        if self.prompt is not None:
            return [self.prompt]
        return list(self.args)

    def start_args(self, project_dir: str,
                   ceilings: tuple[int | str | None, int | str | None, int | None] | None = None) -> list[str]:
        """``agentcell session start`` flags for this plan, its project at ``project_dir``; ``ceilings``
        (memory bytes, CPU percent, tasks) replace the plan's own (:meth:`Caps.ceilings`). Each value is
        joined to its flag (``--flag=VALUE``): a value that starts with ``-`` stays a value."""
        out = [f"--project={project_dir}", f"--harness={self.harness}"]
        memory, cpu, pids = ceilings or (self.memory, self.cpu, self.pids)
        for flag, value in (("--wall-clock", self.wall_clock_s), ("--risk", self.risk), ("--memory", memory),
                            ("--cpu", cpu), ("--pids", pids), ("--net", self.network),
                            ("--resolver", self.resolver), ("--api-base", self.api_base), ("--model", self.model)):
            if value is not None:
                out.append(f"{flag}={value}")
        for flag, values in (("--allow-domain", self.allow_domains), ("--deny-domain", self.deny_domains),
                             ("--allow-preset", self.allow_presets), ("--allow-range", self.allow_ranges)):
            out += [f"{flag}={v}" for v in values]
        out += [f"--env={k}={v}" for k, v in sorted(self.env.items())]
        out += [f"--keep-env={k}" for k in self.keep_env]
        return [*out, "--", *self.harness_args()]


TRUSTED_NETWORK = "--trust-plan-network"


@dataclass(frozen=True)
class Caps:
    """What the operator lets a plan ask for (``agentcell fleet run`` and ``agentcell k8s render``: ``--max-*``,
    ``--trust-plan-network``, ``--allow-api-base``, ``--allow-keep-env``). A plan is written by someone less
    trusted than the nodes' root: it may choose ceilings up to these, never its own way to non-public
    addresses (another node, the Ray head, the cloud's metadata) unless the operator says so, and never where
    the nodes' keys go."""

    memory: int | None = None  # bytes; None: the node's most generous default (risk low)
    cpu: int | None = None  # percent of one CPU; None: likewise
    pids: int | None = None
    wall_clock_s: int = 86400
    plan_network: bool = False  # plans may set allow_ranges, resolver and network host-firewall, and clone from
    # non-public addresses
    api_bases: tuple[str, ...] = ()  # the api_base values a plan may give (its host gets the harness's key)
    keep_env: tuple[str, ...] = ()  # the variables of the nodes' keys a plan may pass into its cell
    keys: bool = False  # the nodes hold harness keys (--node-env-file, --env-secret)

    @classmethod
    def from_flags(cls, *, memory: str | None, cpu: str | None, pids: str | None, wall_clock: str | None,
                   plan_network: bool, api_bases: Sequence[str], keep_env: Sequence[str], keys: bool) -> Caps:
        """The caps as the operator typed them (``--max-memory`` and the rest); ``keys``: the nodes hold
        harness keys."""
        from .. import limits

        if wall_clock is not None and (not wall_clock.isdigit() or int(wall_clock) < 1):
            raise AgentcellError("--max-wall-clock", f"'{wall_clock}' is not a number of seconds",
                                 "e.g. --max-wall-clock 3600")
        return cls(memory=limits.parse_size(memory, "--max-memory") if memory else None,
                   cpu=limits.parse_cpu(cpu, "--max-cpu") if cpu else None,
                   pids=limits.parse_pids(pids, "--max-pids") if pids else None,
                   wall_clock_s=int(wall_clock) if wall_clock else 86400, plan_network=plan_network,
                   api_bases=tuple(api_bases), keep_env=tuple(keep_env), keys=keys)

    def check(self, plan: SessionPlan, where: str) -> None:
        """Refuse what the plan asks beyond these (at the caller, before anything is sent)."""
        from ..limits import parse_cpu, parse_pids, parse_size

        fix = "lower it in the plan, or raise the cap (agentcell fleet run --help)"
        if plan.wall_clock_s and plan.wall_clock_s > self.wall_clock_s:
            raise AgentcellError(f"{where}: wall_clock_s", f"{plan.wall_clock_s} s is over the cap of "
                                 f"{self.wall_clock_s} s (--max-wall-clock)", fix)
        for field, value, cap, flag, parse in (("memory", plan.memory, self.memory, "--max-memory", parse_size),
                                               ("cpu", plan.cpu, self.cpu, "--max-cpu", parse_cpu),
                                               ("pids", plan.pids, self.pids, "--max-pids", parse_pids)):
            if value is None:
                continue
            try:
                asked = parse(str(value), field)
            except AgentcellError as e:
                raise AgentcellError(f"{where}: {field}", e.problem, e.fix) from None
            if cap is not None and asked > cap:
                raise AgentcellError(f"{where}: {field}", f"{value} is over the cap of {cap} ({flag})", fix)
        if not self.plan_network:
            opened = [k for k in ("allow_ranges", "resolver") if getattr(plan, k)]
            opened += ["network host-firewall"] if plan.network == "host-firewall" else []
            if opened:
                raise AgentcellError(f"{where}: {opened[0].split()[0]}", f"a plan may not set {opened[0]}: it would "
                                     "open a way to non-public addresses (other nodes, the Ray head) or "
                                     "past the name allow-list", f"remove it, or run with {TRUSTED_NETWORK}")
        if plan.api_base is not None and plan.api_base not in self.api_bases:
            raise AgentcellError(f"{where}: api_base", "a plan may not choose where the harness's key goes (its "
                                 "host is given the key)", f"remove it, or allow it: --allow-api-base {plan.api_base}")
        extra = [k for k in plan.keep_env if k not in self.keep_env]
        if extra:
            raise AgentcellError(f"{where}: keep_env", f"a plan may not take {extra[0]} from the nodes",
                                 f"remove it, or allow it: --allow-keep-env {extra[0]}")
        if self.keys and plan.harness not in ("shell", "scripted") and plan.network not in (None, "proxy"):
            raise AgentcellError(f"{where}: network", f"with network {plan.network} the nodes' keys would enter "
                                 "the cell as they are (the proxy keeps them out)", "remove it: the harness's "
                                 "own is the proxy")

    def bounded(self, plan: SessionPlan) -> tuple[int | str | None, int | str | None, int | None]:
        """Where the node's own defaults are not known (a pod): the plan's ceilings where it gives them
        (:meth:`check` holds them to the caps), else the caps (None: the session's default there)."""
        return (plan.memory if plan.memory is not None else self.memory,
                plan.cpu if plan.cpu is not None else self.cpu, plan.pids if plan.pids is not None else self.pids)

    def ceilings(self, plan: SessionPlan) -> tuple[int, int, int]:
        """On the node: the plan's ceilings (its own, or its risk level's here), held to the caps (or, where
        none is given, to this node's most generous default)."""
        from ..limits import for_risk, parse_cpu, parse_pids, parse_size

        asked = list(for_risk(plan.risk or "medium"))
        for i, (value, parse) in enumerate(((plan.memory, parse_size), (plan.cpu, parse_cpu),
                                            (plan.pids, parse_pids))):
            if value is not None:
                asked[i] = parse(str(value))
        roof = for_risk("low")
        caps = (self.memory or roof[0], self.cpu or roof[1], self.pids or roof[2])
        return min(asked[0], caps[0]), min(asked[1], caps[1]), min(asked[2], caps[2])


GIT_PORTS = {"https": 443, "http": 80, "ssh": 22, "git": 9418}  # the transports a plan's clone may use


def git_remote(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) that a clone of ``url`` connects to; None for a path or a file:// URL (read on
    the machine itself). ValueError (its text follows the URL): another scheme, no host, a bad port."""
    if "://" in url:
        parts = urlsplit(url)
        if parts.scheme == "file":
            return None
        try:
            port = parts.port
        except ValueError:
            raise ValueError("has a bad port") from None
        if parts.scheme not in GIT_PORTS or not parts.hostname:
            raise ValueError("is not a URL to clone from")
        return parts.scheme, parts.hostname, port or GIT_PORTS[parts.scheme]
    head = url.split(":", 1)[0]
    if ":" in url and head and "/" not in head:  # [user@]host:path, git's scp-like form of ssh
        return "ssh", head.rsplit("@", 1)[-1], 22
    return None


def public(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``addr`` is public, as the egress proxy judges an address a name resolved to (with no
    --allow-range): never loopback, private, link-local or an IPv4 one carried in IPv6."""
    from ..network.rules import Policy

    return Policy.from_rules(()).address_verdict(addr)[0]


def _where(err: ValidationError) -> tuple[str, str]:
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "plan"
    return field, str(first["msg"]).removeprefix("Value error, ")


def parse(obj: Any, where: str = "plan") -> SessionPlan:
    try:
        return SessionPlan.model_validate(obj)
    except ValidationError as e:
        field, msg = _where(e)
        raise AgentcellError(f"{where}: {field}", msg, "see 'agentcell fleet run --help' for a plan's fields") from None


def read(path: str) -> list[SessionPlan]:
    """A plans file (JSON lines; blank lines and lines starting with # skipped). Every line is checked
    before any is used; names must be unique."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise AgentcellError("PLANS", f"cannot read {path}: {e.strerror}", "give a JSON-lines file of plans") from None
    except UnicodeDecodeError:
        raise AgentcellError("PLANS", f"{path} is not UTF-8 text", "give a JSON-lines file of plans") from None
    plans: list[SessionPlan] = []
    seen: dict[str, int] = {}
    for n, line in _numbered(lines):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise AgentcellError(f"{path}:{n}", f"not JSON ({e.msg} at column {e.colno})",
                                 "one JSON object per line") from None
        plan = parse(obj, f"{path}:{n}")
        if plan.name in seen:
            raise AgentcellError(f"{path}:{n}: name", f"'{plan.name}' is also the name on line {seen[plan.name]}",
                                 "give each plan its own name")
        seen[plan.name] = n
        plans.append(plan)
    if not plans:
        raise AgentcellError("PLANS", f"{path} has no plans", "one JSON object per line")
    if len(plans) > MAX_PLANS:
        raise AgentcellError("PLANS", f"{path} has {len(plans)} plans", f"split it: at most {MAX_PLANS} a run")
    return plans


def _numbered(lines: list[str]) -> Iterator[tuple[int, str]]:
    for n, line in enumerate(lines, 1):
        if line.strip() and not line.lstrip().startswith("#"):
            yield n, line
