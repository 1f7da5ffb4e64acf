"""The compiled, spelled-out description of one cell: what the launcher consumes.

Plain frozen dataclasses (no pydantic) so ``agentcell run`` stays fast; the pydantic
``SandboxPolicy`` in :mod:`agentcell.policy` compiles down to a :class:`CellSpec`.
Every path here is already absolute and resolved; the launcher re-opens each one without
following symlinks and refuses if it changed since.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

NetworkMode = Literal["none", "loopback"]

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
CELL_HOSTNAME = "agentcell"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


@dataclass(frozen=True)
class Identity:
    """Who the command runs as.

    ``userns`` identities (mode ``self``) map the invoking uid into a new user namespace;
    the others are real host accounts the root supervisor switches to.
    """

    mode: Literal["self", "agent", "uid"]
    uid: int
    gid: int
    user: str
    home: str
    groups: tuple[int, ...] = ()

    @property
    def userns(self) -> bool:
        return self.mode == "self"


@dataclass(frozen=True)
class CellSpec:
    identity: Identity
    rw_paths: tuple[str, ...] = ()
    ro_paths: tuple[str, ...] = ()
    masked_paths: tuple[str, ...] = ()
    system_paths: tuple[str, ...] = SYSTEM_RO_PATHS
    scratch_dir: str | None = None  # host dir behind /scratch; None = a private tmpfs
    home_dir: str | None = None  # host dir behind $HOME; None = a private tmpfs
    network: NetworkMode = "none"
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    hostname: str = CELL_HOSTNAME
    cell_id: str = field(default="", compare=False)

    def environ(self) -> dict[str, str]:
        return dict(self.env)


def spec_to_dict(spec: CellSpec) -> dict[str, object]:
    """JSON-ready form (the warm launcher receives specs over a socket)."""
    from dataclasses import asdict

    return asdict(spec)


def spec_from_dict(d: dict[str, object]) -> CellSpec:
    d = dict(d)
    ident = dict(d.pop("identity"))  # type: ignore[call-overload]
    ident["groups"] = tuple(ident.get("groups", ()))
    tuples = ("rw_paths", "ro_paths", "masked_paths", "system_paths")
    for k in tuples:
        d[k] = tuple(d[k])  # type: ignore[call-overload]
    d["env"] = tuple((str(k), str(v)) for k, v in d["env"])  # type: ignore[attr-defined]
    return CellSpec(identity=Identity(**ident), **d)  # type: ignore[arg-type]
