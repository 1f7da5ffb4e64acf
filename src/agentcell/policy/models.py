"""The policy layer's data: what a session asks for, what it is granted, what it tried beyond that.

Plain pydantic models with no I/O. :class:`SessionPlan` is the request (from a TOML file, the CLI or
the session graph); :func:`agentcell.policy.compile.compile_plan` turns it into a :class:`SandboxPolicy`
whose every path is resolved and every refusal already made; :meth:`SandboxPolicy.to_cell_spec`
hands it to the launcher. Every model forbids unknown keys, so a misspelt key in a policy file is an
error rather than a silently ignored setting.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ..cell.spec import CellSpec, Identity

Risk = Literal["low", "medium", "high"]
Network = Literal["none", "loopback", "proxy", "host-firewall"]
LandlockMode = Literal["required", "best-effort"]
Operation = Literal["read", "write", "execute", "network", "resource", "telemetry"]

# Strict: in a policy file `pids = true` must be an error, not a ceiling of 1.
PositiveInt = Annotated[StrictInt, Field(gt=0)]
# Session ids end up in cgroup, account and state-dir names: no slashes, no spaces, bounded length.
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# The shape resolve_identity accepts; checked here too so a policy file fails when it is loaded.
IDENTITY_PATTERN = r"^(self|agent:[A-Za-z0-9_][A-Za-z0-9_.-]*|[0-9]+)$"
# A variable name, as build_env requires; checked here so a key like "A=B" cannot smuggle in another name.
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


def _new_session_id() -> str:
    return uuid.uuid4().hex


class Limits(BaseModel):
    """Resource ceilings for the cell's cgroup; ``None`` takes the launcher's default (75 % of RAM,
    no CPU cap, 4096 tasks; see agentcell.cell.cgroups)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_bytes: PositiveInt | None = None
    cpu_percent: PositiveInt | None = None  # of one CPU: 200 = two full CPUs
    pids: PositiveInt | None = None


class SessionPlan(BaseModel):
    """What a session asks for, before anything is resolved or refused."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(default_factory=_new_session_id, pattern=SESSION_ID_PATTERN)
    harness: str = Field(min_length=1)
    declared_paths: list[str]  # shared read-write
    excluded_paths: list[str] = Field(default_factory=list)  # inside a declared path; hidden in the cell
    risk: Risk = "medium"
    wall_clock_limit_s: PositiveInt = 3600
    ro_paths: list[str] = Field(default_factory=list)
    masked_paths: list[str] = Field(default_factory=list)
    scratch: str | None = None  # host dir behind /scratch; None = a private tmpfs
    home: str | None = None  # host dir behind $HOME; None = a private tmpfs
    # identity agent:NAME: its own home (/home/NAME, kept between sessions) behind $HOME
    home_persistent: StrictBool = False
    network: Network = "none"
    limits: Limits = Field(default_factory=Limits)
    identity: str = Field(default="self", pattern=IDENTITY_PATTERN)
    env: dict[EnvName, str] = Field(default_factory=dict)  # set in the cell
    keep_env: list[EnvName] = Field(default_factory=list)  # passed through from the host
    # The explicit override for /, home dirs, credential stores and writable system dirs.
    allow_unsafe_paths: StrictBool = False
    # Landlock: below landlock_min_abi the launch fails closed, unless landlock = "best-effort".
    landlock: LandlockMode = "required"
    landlock_min_abi: StrictInt = Field(default=1, ge=1, le=64)
    allow_write: list[str] = Field(default_factory=list)  # protected paths the command may write
    # network = "proxy": the domain allow-list (agentcell.network.rules), named lists, ranges a name
    # may resolve into, and the proxy's DNS server (default: the host's resolver).
    allow_domains: list[str] = Field(default_factory=list)
    deny_domains: list[str] = Field(default_factory=list)
    allow_presets: list[str] = Field(default_factory=list)
    allow_ranges: list[str] = Field(default_factory=list)
    resolver: str | None = None
    # network = "host-firewall": what the agent's uid may reach ([tcp:|udp:]ADDR|CIDR|*:PORT, or "seed").
    allow_egress: list[str] = Field(default_factory=list)
    allow_loopback: StrictBool = False


class IdentityModel(BaseModel):
    """Mirror of :class:`agentcell.cell.spec.Identity`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["self", "agent", "uid"]
    uid: StrictInt = Field(ge=0)
    gid: StrictInt = Field(ge=0)
    user: str
    home: str
    groups: tuple[int, ...] = ()

    @classmethod
    def from_identity(cls, ident: Identity) -> IdentityModel:
        return cls(mode=ident.mode, uid=ident.uid, gid=ident.gid, user=ident.user, home=ident.home,
                   groups=ident.groups)

    def to_identity(self) -> Identity:
        return Identity(self.mode, self.uid, self.gid, self.user, self.home, self.groups)


class SandboxPolicy(BaseModel):
    """The compiled, spelled-out policy of one session: every path resolved, every refusal made.

    The seed's summary fields (``os_user`` … ``firewall_rule``) come first; the cell fields after
    them are what :meth:`to_cell_spec` hands to the launcher.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    os_user: str
    read_paths: tuple[str, ...]  # host paths the cell can read: ro paths and the system dirs present
    write_paths: tuple[str, ...]  # host paths the cell can change: rw paths, scratch and home dirs
    env_allowlist: tuple[str, ...]  # names of the variables the cell gets, sorted
    firewall_rule: str  # the network mode in words

    session_id: str = Field(pattern=SESSION_ID_PATTERN)
    ro_paths: tuple[str, ...] = ()
    rw_paths: tuple[str, ...] = ()
    masked_paths: tuple[str, ...] = ()
    scratch_dir: str | None = None
    home_dir: str | None = None
    network: Network = "none"
    limits: Limits = Field(default_factory=Limits)
    identity: IdentityModel
    env: tuple[tuple[str, str], ...] = ()  # the final scrubbed environment, in order
    cwd: str
    wall_clock_limit_s: PositiveInt = 3600
    landlock: LandlockMode = "required"
    landlock_min_abi: StrictInt = Field(default=1, ge=1, le=64)
    allow_write: tuple[str, ...] = ()
    egress: tuple[str, ...] = ()  # network = "proxy": its rules as text

    def to_cell_spec(self) -> CellSpec:
        """The launcher's view (the wall clock is the supervisor's to enforce, not the spec's)."""
        return CellSpec(
            identity=self.identity.to_identity(),
            rw_paths=self.rw_paths,
            ro_paths=self.ro_paths,
            masked_paths=self.masked_paths,
            scratch_dir=self.scratch_dir,
            home_dir=self.home_dir,
            network=self.network,
            egress=self.egress,
            env=self.env,
            cwd=self.cwd,
            landlock=self.landlock,
            landlock_min_abi=self.landlock_min_abi,
            allow_write=self.allow_write,
            memory_max=self.limits.memory_bytes,
            cpu_percent=self.limits.cpu_percent,
            pids_max=self.limits.pids,
            cell_id=f"agentcell-{self.session_id}",
        )


class EscapeEvent(BaseModel):
    """One attempt by the cell to go beyond its policy, normalised from any monitor source."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_id: str
    operation: Operation
    target: str  # the path, host:port, binary or resource that was reached for
    reason: str  # the rule that refused it, or why it counts as an escape
    pid: int | None = None
    exe: str | None = None
    source: str  # the monitor source that saw it: landlock, exec, canary, proxy, nftables, cgroup, …
    ts: float = Field(default_factory=time.time)
    ancestry: list[tuple[int, str, str]] = Field(default_factory=list)  # [pid, exe, command line] of its parents
