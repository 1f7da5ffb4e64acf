"""The compiled, spelled-out description of one cell: what the launcher consumes.

Plain frozen dataclasses (no pydantic) so ``agentcell run`` stays fast; the pydantic
``SandboxPolicy`` in :mod:`agentcell.policy` compiles down to a :class:`CellSpec`.
Every path here is already absolute and resolved; the launcher re-opens each one without
following symlinks and refuses if it changed since.
"""
from __future__ import annotations

# Not ``from typing import TYPE_CHECKING``: typing imports re, ~10 ms on every ``agentcell run``.
# mypy is told (pyproject: always_true) to treat this flag as true.
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Literal

    NetworkMode = Literal["none", "loopback", "proxy", "host-firewall"]
    IdentityMode = Literal["self", "agent", "uid"]
    LandlockMode = Literal["required", "best-effort"]

# The network modes, narrowest first (each reaches more than the one before). The one definition: the
# Literal types (NetworkMode here, policy.models.Network) spell them again for type checkers, and a
# test holds them equal to this.
NETWORK_MODES: tuple[str, ...] = ("none", "loopback", "proxy", "host-firewall")

# Bound read-only (nosuid, nodev) when they exist on the host: what a typical toolchain needs.
# Top-level symlinks (merged /usr: /bin -> usr/bin) are recreated as symlinks.
SYSTEM_RO_PATHS: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")

# Hidden inside the cell even though /etc is visible: replaced by an empty, mode-000 file.
SECRET_FILES: tuple[str, ...] = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/security/opasswd",
    "/etc/ssh/ssh_host_rsa_key",
    "/etc/ssh/ssh_host_ecdsa_key",
    "/etc/ssh/ssh_host_ed25519_key",
    "/etc/ssh/ssh_host_dsa_key",
    "/etc/sudoers",
)
# Directories under /etc hidden behind an empty read-only tmpfs.
SECRET_DIRS: tuple[str, ...] = ("/etc/sudoers.d", "/etc/ssl/private", "/etc/NetworkManager/system-connections")

SCRATCH_PATH = "/scratch"
CACHE_PATH = "/cache"  # a session's toolchain caches (agentcell.caches), when it has them
CELL_HOSTNAME = "agentcell"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


class _Frozen:
    """Immutable value object with field-wise equality.

    Written by hand, not with ``dataclasses``: importing dataclasses (inspect, re, ...) costs about
    6 ms on our machines, paid on every ``agentcell run``.
    """

    __slots__: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; use replace()")

    def _init(self, **values: object) -> None:
        for k, v in values.items():
            object.__setattr__(self, k, v)

    def asdict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__slots__}

    def _key(self) -> tuple[object, ...]:
        return tuple(getattr(self, k) for k in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Frozen) and type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self.__slots__)})"


class Identity(_Frozen):
    """Who the command runs as.

    Mode ``self`` maps the invoking uid into a new user namespace; ``agent`` and ``uid`` are real
    host accounts the root supervisor switches to.
    """

    __slots__ = ("mode", "uid", "gid", "user", "home", "groups")
    mode: IdentityMode
    uid: int
    gid: int
    user: str
    home: str
    groups: tuple[int, ...]

    def __init__(self, mode: IdentityMode, uid: int, gid: int, user: str, home: str,
                 groups: tuple[int, ...] = ()) -> None:
        self._init(mode=mode, uid=uid, gid=gid, user=user, home=home, groups=tuple(groups))

    @property
    def userns(self) -> bool:
        return self.mode == "self"


class Workspace(_Frozen):
    """A copy-on-write view of a project (``session start --workspace copy``): the cell sees ``project``
    at its own path as an overlay whose writes land in ``upper`` (``work`` is overlayfs's scratch, on
    the same file system); the project itself is a read-only lower layer, never written. ``hide``: a
    layer above it of whiteouts for what the view leaves out (files git ignores, masked paths), or "".
    ``idmap``: (owner uid, owner gid, account uid, account gid): the project's owner shown in the view as
    the cell's account (an idmapped mount: the account can edit its copy of files it could not write on
    the host), or () where the cell runs as the owner.
    ``userxattr``: overlayfs keeps its marks in user.* xattrs (a rootless cell cannot set trusted.*)."""

    __slots__ = ("project", "upper", "work", "hide", "idmap", "userxattr")
    project: str
    upper: str
    work: str
    hide: str
    idmap: tuple[int, ...]
    userxattr: bool

    def __init__(self, project: str, upper: str, work: str, hide: str = "", idmap: tuple[int, ...] = (),
                 userxattr: bool = False) -> None:
        self._init(project=project, upper=upper, work=work, hide=hide, idmap=tuple(idmap), userxattr=bool(userxattr))


class CellSpec(_Frozen):
    """Everything the launcher needs for one cell, spelled out; paths absolute and resolved."""

    __slots__ = ("identity", "rw_paths", "ro_paths", "masked_paths", "system_paths", "scratch_dir", "home_dir",
                 "cache_dir", "network", "env", "cwd", "hostname", "landlock", "landlock_min_abi", "memory_max",
                 "cpu_percent", "pids_max", "allow_write", "egress", "watch", "workspace", "cell_id")
    identity: Identity
    rw_paths: tuple[str, ...]
    ro_paths: tuple[str, ...]
    masked_paths: tuple[str, ...]
    system_paths: tuple[str, ...]
    scratch_dir: str | None  # host dir behind /scratch; None = a private tmpfs
    home_dir: str | None  # host dir behind $HOME; None = a private tmpfs
    cache_dir: str | None  # host dir behind /cache (agentcell.caches); None = no /cache at all
    network: NetworkMode
    env: tuple[tuple[str, str], ...]
    cwd: str | None
    hostname: str
    landlock: LandlockMode  # required: fail closed below landlock_min_abi; best-effort: run without it
    landlock_min_abi: int
    memory_max: int | None  # bytes; None: the default (75 % of RAM)
    cpu_percent: int | None  # of one core; None: not capped
    pids_max: int | None  # tasks; None: the default (4096)
    allow_write: tuple[str, ...]  # protected paths (protect/) the policy lets the command write
    egress: tuple[str, ...]  # "proxy": its rules (agentcell.network.rules); "host-firewall": its (network.firewall)
    # Under the escape monitor: canary credentials in the home, and seccomp refusals of escape calls
    # reported to the supervisor (a listener it must serve: only a monitor launches such a cell).
    watch: bool
    workspace: Workspace | None  # one of rw_paths seen copy-on-write (see Workspace); None: all bound as they are
    cell_id: str  # a label for reports; two specs that differ only here launch identical cells

    def __init__(self, identity: Identity, *, rw_paths: tuple[str, ...] = (), ro_paths: tuple[str, ...] = (),
                 masked_paths: tuple[str, ...] = (), system_paths: tuple[str, ...] = SYSTEM_RO_PATHS,
                 scratch_dir: str | None = None, home_dir: str | None = None, cache_dir: str | None = None,
                 network: NetworkMode = "none",
                 env: tuple[tuple[str, str], ...] = (), cwd: str | None = None, hostname: str = CELL_HOSTNAME,
                 landlock: LandlockMode = "required", landlock_min_abi: int = 1, memory_max: int | None = None,
                 cpu_percent: int | None = None, pids_max: int | None = None, allow_write: tuple[str, ...] = (),
                 egress: tuple[str, ...] = (), watch: bool = False, workspace: Workspace | None = None,
                 cell_id: str = "") -> None:
        self._init(identity=identity, rw_paths=tuple(rw_paths), ro_paths=tuple(ro_paths),
                   masked_paths=tuple(masked_paths), system_paths=tuple(system_paths), scratch_dir=scratch_dir,
                   home_dir=home_dir, cache_dir=cache_dir, network=network,
                   env=tuple((str(k), str(v)) for k, v in env), cwd=cwd,
                   hostname=hostname, landlock=landlock, landlock_min_abi=landlock_min_abi, memory_max=memory_max,
                   cpu_percent=cpu_percent, pids_max=pids_max, allow_write=tuple(allow_write), egress=tuple(egress),
                   watch=bool(watch), workspace=workspace, cell_id=cell_id)

    def _key(self) -> tuple[object, ...]:
        return tuple(getattr(self, k) for k in self.__slots__ if k != "cell_id")

    def replace(self, **changes: object) -> CellSpec:
        values = self.asdict()
        values.update(changes)
        return CellSpec(**values)  # type: ignore[arg-type]

    def environ(self) -> dict[str, str]:
        """The command's environment; with the proxy, where to find it (unless set explicitly)."""
        env = dict(self.env)
        if self.network == "proxy":
            env = {**proxy_environment(), **env}
        return env


PROXY_PORT = 3128  # inside the cell's own network namespace: nothing else listens there


def proxy_environment() -> dict[str, str]:
    """What tools read to find the cell's proxy (both spellings; SOCKS with names resolved there)."""
    http = f"http://127.0.0.1:{PROXY_PORT}"
    env = {"HTTP_PROXY": http, "HTTPS_PROXY": http, "ALL_PROXY": f"socks5h://127.0.0.1:{PROXY_PORT}",
           "NO_PROXY": "localhost,127.0.0.1,::1"}
    env.update({k.lower(): v for k, v in env.items()})
    return env


def new_cell_id() -> str:
    return "agentcell-" + os.urandom(6).hex()


def spec_to_dict(spec: CellSpec) -> dict[str, object]:
    """JSON-ready form (the warm launcher receives specs over a socket)."""
    d = spec.asdict()
    d["identity"] = spec.identity.asdict()
    if spec.workspace is not None:
        d["workspace"] = spec.workspace.asdict()
    return d


def spec_from_dict(d: dict[str, object]) -> CellSpec:
    values = dict(d)
    ident = Identity(**values.pop("identity"))  # type: ignore[arg-type]
    if values.get("workspace") is not None:
        values["workspace"] = Workspace(**values["workspace"])  # type: ignore[arg-type]
    return CellSpec(ident, **values)  # type: ignore[arg-type]
