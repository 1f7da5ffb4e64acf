"""A session's configuration: the seed's ``.env`` variables, the project's ``agentcell.toml``, CLI flags.

Precedence, highest first: CLI flags > the environment > a ``.env`` file > ``[session]`` in the project's
``agentcell.toml`` > defaults. The names are the seed's:

==================== ============================ =====================================================
variable             ``agentcell.toml [session]``  meaning
==================== ============================ =====================================================
AGENT_HARNESS        harness                      a profile (:mod:`.profiles`): claude_code, shell, …
PROJECT_ROOT         (it locates the file)        the project; default: the current directory
DECLARED_PATHS       declared_paths               shared read-write, ``:`` or ``,`` separated, relative
                                                  to the project; default: the project itself
AGENT_OS_USER        agent                        a persistent agent account; empty: a per-session one
BACKUP_DIR           backup_dir                   the snapshot store of the preflight backup
AUDIT_LOG_PATH       audit_log_path               the hash-chained audit trail
AUDIT_WITNESS        (never from the project)     where the trail's signed heads go (seals the trail)
WALL_CLOCK_LIMIT_S   wall_clock_limit_s           the session ends normally (reason timeout) after it
FIREWALL_ENABLED     firewall_enabled             the seed's host firewall: egress 443 only, deny else
==================== ============================ =====================================================

``AUDIT_WITNESS`` (``--audit-witness``) seals the trail to a witness off the host (:mod:`agentcell.audit.seal`)
if it is not sealed yet, and must name the witness a sealed trail has; ``--audit-witness-required`` (a
flag only) stops the session when the witness does not take a head. ``network`` (none | loopback | proxy |
host-firewall) is a toml key and a flag too, and so is ``risk``
(low | medium | high: the default resource ceilings, :mod:`agentcell.limits`), which a file in the
project may raise but not lower. ``env`` (a table in ``[session]``, ``--env K=V``) sets variables in
the cell; from a file in the project it may not set what configures the harness (its keys, base URLs,
proxies, what its profile sets). ``--keep-env NAME`` passes a variable of the environment (or the
``.env``) through. ``--api-base URL`` (or ``AGENT_API_BASE``) points the harness at a gateway or a
local model server, and ``--model`` (``AGENT_MODEL``) names the model: never from a file in the
project, which must not choose where your API key goes. What a proxy session
may reach beyond its harness's preset (``--allow-domain``, ``--deny-domain``, ``--allow-preset``,
``--allow-range``, ``--resolver``) is taken from flags only: the project's files are the agent's to
write, and must not widen the next session's egress. The API-key variables
a harness needs (``ANTHROPIC_API_KEY``, …) are read from the environment or ``.env`` and passed into
the cell only for that harness (its profile lists them). Every bad value is one
:class:`~agentcell.errors.PolicyError` naming where it came from and the fix.

The files are read by :mod:`.sources`; the options beyond the project, its paths and its network
(the model, risk and ceilings, caches, workspace, the cell's environment, the home) are checked by
:mod:`.options`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..cell.spec import NETWORK_MODES
from ..errors import PolicyError
from .options import _harness_knobs
from .sources import FLAGS, _inside, read_dotenv_owned, read_toml

ENV_NAMES = ("AGENT_HARNESS", "PROJECT_ROOT", "DECLARED_PATHS", "AGENT_OS_USER", "BACKUP_DIR", "AUDIT_LOG_PATH",
             "AUDIT_WITNESS", "WALL_CLOCK_LIMIT_S", "FIREWALL_ENABLED", "AGENT_API_BASE", "AGENT_MODEL", "AGENT_RISK")
NETWORKS = NETWORKS_BY_WIDTH = NETWORK_MODES
EGRESS_KEYS = ("allow_domains", "deny_domains", "allow_presets", "allow_ranges")  # lists; resolver: one value
DEFAULT_WALL_CLOCK_S = 3600
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class SessionConfig:
    """Everything a session is started with, before the plan: each value already checked."""

    harness: str = "shell"
    project_root: str = ""
    declared_paths: tuple[str, ...] = ()  # absolute; empty until resolve(): the project itself
    agent: str | None = None  # persistent agent account; None: an ephemeral per-session account
    backup_dir: str | None = None  # None: the snapshot store's default (<state dir>/snapshots)
    audit_log_path: str | None = None  # None: the audit trail's default
    audit_witness: str | None = None  # the witness the trail is sealed to (agentcell.audit.witness), if given
    audit_witness_required: bool = False  # a head the witness does not take stops the session
    wall_clock_limit_s: int = DEFAULT_WALL_CLOCK_S
    firewall_enabled: bool = False
    network: str | None = None  # None: host-firewall if firewall_enabled, proxy with a domain rule, else the profile's
    allow_domains: tuple[str, ...] = ()  # the proxy's rules beyond the harness's preset: flags only
    deny_domains: tuple[str, ...] = ()
    allow_presets: tuple[str, ...] = ()
    allow_ranges: tuple[str, ...] = ()
    resolver: str | None = None
    api_base: str | None = None  # the harness's model API (a gateway, a local server): flags and environment only
    model: str | None = None
    risk: str = "medium"  # the default ceilings (agentcell.limits); a project file may raise it
    limits: tuple[int | None, int | None, int | None] = (None, None, None)  # memory, cpu, pids: resolved
    ceilings: bool = True  # False: --ceilings off (no cgroup limits at all: recorded, shown in the summary)
    cache: bool = True  # the project's toolchain caches at /cache (agentcell.caches); False: --cache off
    workspace: str = "direct"  # direct: the project itself; copy: a copy-on-write view (agentcell.workspace)
    workspace_include: tuple[str, ...] = ()  # ignored paths the copy shows all the same (relative to the project)
    env: tuple[tuple[str, str], ...] = ()  # set in the cell (--env, [session] env)
    keep_env: tuple[str, ...] = ()  # passed through (--keep-env): values in ``secrets``, never checkpointed
    home_from: str | None = None  # an ephemeral home starts as a copy of this directory (--home-from)
    git_identity: str | None = None  # "Name <email>" the agent commits as (--git-identity); None: the human's, marked
    harness_args: tuple[str, ...] = ()
    config_files: tuple[str, ...] = ()  # the .env and agentcell.toml read (or looked for): see nodes.plan
    secrets: dict[str, str] = field(default_factory=dict)  # API-key variables found (env or .env), by name
    notes: tuple[str, ...] = ()  # what the user should know (a .env line not passed on)
    sources: dict[str, str] = field(default_factory=dict)  # field -> where its value came from

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, without secret values (their names only)."""
        return {"harness": self.harness, "project_root": self.project_root,
                "declared_paths": list(self.declared_paths), "agent": self.agent, "backup_dir": self.backup_dir,
                "audit_log_path": self.audit_log_path, "audit_witness": self.audit_witness,
                "audit_witness_required": self.audit_witness_required, "wall_clock_limit_s": self.wall_clock_limit_s,
                "firewall_enabled": self.firewall_enabled, "network": self.network,
                **{k: list(getattr(self, k)) for k in EGRESS_KEYS}, "resolver": self.resolver,
                "api_base": self.api_base, "model": self.model, "risk": self.risk, "limits": list(self.limits),
                "ceilings": self.ceilings, "cache": self.cache, "workspace": self.workspace,
                "workspace_include": list(self.workspace_include),
                "env": [list(kv) for kv in self.env], "keep_env": list(self.keep_env), "home_from": self.home_from,
                "git_identity": self.git_identity,
                "harness_args": list(self.harness_args), "config_files": list(self.config_files),
                "secret_names": sorted(self.secrets),
                "sources": dict(self.sources)}


def _protected_around(path: str, surface: tuple[str, ...]) -> str | None:
    """The protected entry (:func:`agentcell.protect.surface.protected_surface`) ``path`` is or lies in."""
    return next((p for p in surface if path == p or path.startswith(p.rstrip("/") + "/")), None)


def _bool(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise PolicyError(where, f"'{value}' is not a boolean", "use true or false")


def _seconds(value: object, where: str) -> int:
    if isinstance(value, bool):
        raise PolicyError(where, f"'{value}' is not a number of seconds", "use a whole number above 0, e.g. 600")
    try:
        n = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise PolicyError(where, f"'{value}' is not a number of seconds",
                          "use a whole number above 0, e.g. 600") from None
    if n <= 0:
        raise PolicyError(where, f"{n} is not above 0", "use a whole number of seconds above 0, e.g. 600")
    return n


def _paths(value: object, where: str) -> list[str]:
    if isinstance(value, list):
        items = value
    elif isinstance(value, str):
        items = [p for chunk in value.split(":") for p in chunk.split(",")]
    else:
        raise PolicyError(where, "is not a list of paths", "e.g. src:tests, or [\"src\", \"tests\"] in toml")
    out = []
    for p in items:
        if not isinstance(p, str):
            raise PolicyError(where, f"{p!r} is not a path", "give paths as strings")
        if p.strip():
            out.append(p.strip())
    return out


def _agent(value: object, where: str) -> str | None:
    text = str(value).strip()
    if not text:
        return None
    from ..accounts.accounts import AccountError, check_name

    try:
        return check_name(text)
    except AccountError as e:
        raise PolicyError(where, e.problem, e.fix) from None


# Decided by the operator (a flag, or root's own environment), never by a file in the project that
# its owner (or an earlier session's agent) could have written: where root writes the backup and the
# audit trail, which persistent agent runs, which directory is the project, and where the harness
# sends your API key (and whatever the agent gives it).
_WHERE_ROOT = "where root writes, and as whom the agent runs, is not taken from a file in the project"
_WHERE_KEY = "where the harness sends your API key is not taken from a file in the project"
_WHICH_MODEL = ("the model your key pays for is not taken from a file in the project (its name lands in the "
                "harness's own configuration)")
HOST_KEYS: dict[str, str] = {"backup_dir": _WHERE_ROOT, "audit_log_path": _WHERE_ROOT, "audit_witness": _WHERE_ROOT,
                             "agent": _WHERE_ROOT, "project_root": _WHERE_ROOT, "api_base": _WHERE_KEY,
                             "model": _WHICH_MODEL}


def load(flags: Mapping[str, Any], *, environ: Mapping[str, str] | None = None, cwd: str | None = None,
         dotenv: str | None = None, secret_names: tuple[str, ...] = ()) -> SessionConfig:
    """Merge the four sources. ``flags`` holds the CLI's values (None: not given), keyed like the
    fields; ``dotenv`` a ``.env`` path (default: ``.env`` in ``cwd``)."""
    environ = dict(os.environ if environ is None else environ)
    cwd = cwd or os.getcwd()
    dot_path = dotenv or os.path.join(cwd, ".env")
    dot, dot_ours = read_dotenv_owned(dot_path, explicit=dotenv is not None)
    env_view = {**dot, **environ}  # the real environment wins over the file

    def env_where(name: str) -> str:
        return name if name in environ else f"{name} (in {dot_path})"

    sources: dict[str, str] = {}
    root_flag = flags.get("project_root")
    if root_flag:
        root, sources["project_root"] = str(root_flag), "--project"
    elif environ.get("PROJECT_ROOT"):
        root, sources["project_root"] = environ["PROJECT_ROOT"], "PROJECT_ROOT"
    elif dot.get("PROJECT_ROOT") and dot_ours:
        root, sources["project_root"] = dot["PROJECT_ROOT"], env_where("PROJECT_ROOT")
    elif dot.get("PROJECT_ROOT"):
        raise PolicyError(env_where("PROJECT_ROOT"), "the project is not chosen by a file someone other than you "
                          "can write", "give --project, or set PROJECT_ROOT in the environment")
    else:
        root, sources["project_root"] = cwd, "the current directory"
    root = os.path.abspath(os.path.join(cwd, os.path.expanduser(root)))
    if not os.path.isdir(root):
        raise PolicyError(sources["project_root"], f"{root} is not a directory", "name the project's directory")
    if dot_ours and _inside(dot_path, [root]):
        # The project's owner and its agents write there (an agent's file may even be handed to you).
        if sources["project_root"] == env_where("PROJECT_ROOT") and "PROJECT_ROOT" not in environ:
            raise PolicyError(env_where("PROJECT_ROOT"), "the project is not chosen by a file inside it",
                              "give --project, or set PROJECT_ROOT in the environment")
        dot_ours = False
    toml = read_toml(root)
    toml_where = os.path.join(root, "agentcell.toml") + ": session."
    for key in sorted(HOST_KEYS.keys() & set(toml)):  # never honoured there, so never silently ignored either
        raise PolicyError(toml_where + key, HOST_KEYS[key], f"remove it; give {FLAGS[key]} instead")

    def pick(key: str, env: str | None) -> tuple[object, str] | None:
        flag_value = flags.get(key)
        if flag_value not in (None, [], ()):
            return flag_value, FLAGS[key]
        if env is not None and env_view.get(env, "") != "":
            if key in HOST_KEYS and env not in environ and not dot_ours:  # a .env someone else could write
                raise PolicyError(env_where(env), HOST_KEYS[key], f"give {FLAGS[key]}, set {env} in the environment, "
                                  "or name a file outside the project that only you can write with --env-file")
            return env_view[env], env_where(env)
        if key in toml:
            if key in HOST_KEYS:
                raise PolicyError(toml_where + key, HOST_KEYS[key], f"give {FLAGS[key]} instead")
            return toml[key], toml_where + key
        return None

    cfg = SessionConfig(project_root=root)
    values: dict[str, Any] = {}
    if (got := pick("harness", "AGENT_HARNESS")) is not None:
        value, where = got
        from ..harness.profiles import PROFILES

        if str(value) not in PROFILES:
            raise PolicyError(where, f"unknown harness '{value}'", "one of " + ", ".join(PROFILES))
        values["harness"], sources["harness"] = str(value), where
    if (got := pick("declared_paths", "DECLARED_PATHS")) is not None:
        value, where = got
        rel = _paths(value, where)
        declared = tuple(os.path.normpath(os.path.join(root, os.path.expanduser(p))) for p in rel)
        if (" (in " in where and not dot_ours) or where.startswith(toml_where):
            # From a file in the project: only paths inside the project (resolved, links followed).
            from ..protect.surface import protected_part, protected_surface

            real_root = os.path.realpath(root)
            surface, cut_short = protected_surface(real_root)
            if cut_short:  # what decides what runs may lie past the scan's limits
                raise PolicyError(where, "the project is too large to check what its files declare (the scan "
                                  "for hooks and harness config stopped at its limits)",
                                  "give the paths with --rw instead")
            for d in declared:
                real = os.path.realpath(d)
                if real != real_root and not real.startswith(real_root + "/"):
                    raise PolicyError(where, f"{d} is outside the project", "a project's own files may declare only "
                                      "paths inside it; give others with --rw")
                if (part := protected_part(real, real_root) or _protected_around(real, surface)) is not None:
                    raise PolicyError(where, f"{d} is or lies in {part}, which decides what git, your shell or "
                                      "your agent runs", "a project's own files may not open it to the agent; "
                                      "give it with --rw if you mean it")
        values["declared_paths"] = declared
        sources["declared_paths"] = where
    if (got := pick("agent", "AGENT_OS_USER")) is not None:
        values["agent"], sources["agent"] = _agent(got[0], got[1]), got[1]
    for key, env in (("backup_dir", "BACKUP_DIR"), ("audit_log_path", "AUDIT_LOG_PATH")):
        if (got := pick(key, env)) is not None:
            value, where = got
            if not isinstance(value, str) or not value.strip():
                raise PolicyError(where, f"{value!r} is not a path", "give an absolute path")
            values[key], sources[key] = os.path.abspath(os.path.join(root, os.path.expanduser(value))), where
    if (got := pick("audit_witness", "AUDIT_WITNESS")) is not None:
        from ..audit.witness import WitnessError, parse

        try:
            values["audit_witness"], sources["audit_witness"] = str(parse(str(got[0]), got[1])), got[1]
        except WitnessError as e:
            raise PolicyError(e.field, e.problem, e.fix) from None
    if flags.get("audit_witness_required"):  # a flag only
        values["audit_witness_required"] = True
        sources["audit_witness_required"] = FLAGS["audit_witness_required"]
    if (got := pick("wall_clock_limit_s", "WALL_CLOCK_LIMIT_S")) is not None:
        values["wall_clock_limit_s"], sources["wall_clock_limit_s"] = _seconds(*got), got[1]
        if _project_file(got[1], toml_where, dot_ours) and values["wall_clock_limit_s"] > DEFAULT_WALL_CLOCK_S:
            raise PolicyError(got[1], f"a file in the project may shorten the session's wall clock, never lengthen "
                              f"it past {DEFAULT_WALL_CLOCK_S} s (an agent can write that file)",
                              f"give --wall-clock {values['wall_clock_limit_s']} on the command line")
    if (got := pick("firewall_enabled", "FIREWALL_ENABLED")) is not None:
        values["firewall_enabled"], sources["firewall_enabled"] = _bool(*got), got[1]
    if (got := pick("network", None)) is not None:
        value, where = got
        if value not in NETWORKS:
            raise PolicyError(where, f"'{value}' is not a network mode", "one of " + ", ".join(NETWORKS))
        values["network"], sources["network"] = str(value), where
    if values.get("firewall_enabled") and values.get("network") not in (None, "host-firewall"):
        raise PolicyError(sources["network"], f"network {values['network']} contradicts FIREWALL_ENABLED "
                          f"(from {sources['firewall_enabled']})", "drop one of them")
    # A file in the project may narrow the network its harness gets, never widen it: a cloned repository
    # (or an earlier agent) must not open the host's network to the next session. Nor may it pick a
    # harness that brings a network or API keys of its own.
    from ..harness.profiles import PROFILES

    def by_file(where: str) -> bool:
        return _project_file(where, toml_where, dot_ours)

    harness = str(values.get("harness", cfg.harness))
    harness_by_file = by_file(sources.get("harness", ""))
    if harness_by_file and (PROFILES[harness].network != "none" or PROFILES[harness].secret_env):
        # With a harness come its egress preset and your API keys: that choice is yours to make.
        raise PolicyError(sources["harness"], f"a harness chosen by a file in the project may not bring the network "
                          f"or your API keys ({harness})", f"give --harness {harness}, or set AGENT_HARNESS in the "
                          "environment")
    allowed = PROFILES[harness].network
    if "network" in values:
        key, asked = "network", str(values["network"])
    elif values.get("firewall_enabled"):
        key, asked = "firewall_enabled", "host-firewall"
    else:
        key, asked = "", allowed
    where = sources.get(key, "")
    if key and by_file(where) and NETWORKS_BY_WIDTH.index(asked) > NETWORKS_BY_WIDTH.index(allowed):
        raise PolicyError(where, f"a file in the project may not widen the network beyond the harness's {allowed}",
                          f"give {FLAGS[key]} on the command line")
    for key in EGRESS_KEYS:  # flags only (see the module's doc)
        if flags.get(key):
            values[key], sources[key] = tuple(str(v) for v in flags[key]), FLAGS[key]
    if flags.get("resolver"):
        values["resolver"], sources["resolver"] = str(flags["resolver"]), FLAGS["resolver"]
    _harness_knobs(values, sources, flags, pick, by_file, toml, toml_where, PROFILES[harness], root)
    values["harness_args"] = tuple(flags.get("harness_args") or ())
    if dot_ours and values.get("declared_paths") and _inside(dot_path, list(values["declared_paths"])):
        from_file = sorted(k for k, where in sources.items() if where.endswith(f"(in {dot_path})"))
        if from_file:
            raise PolicyError(dot_path, "lies in a declared path the agent can write, yet it sets "
                              + ", ".join(from_file), "keep this .env outside the project and its declared paths")
    from ..hostfs import state_dir

    if _inside(state_dir(), [root, *values.get("declared_paths", ())]):
        raise PolicyError("AGENTCELL_STATE_DIR", f"{state_dir()} lies in the project or a declared path, which the "
                          "agent can write: the sessions' records would be its", "keep the state dir outside it")
    for key in ("audit_log_path", "backup_dir"):  # root's own records, never where the agent writes
        place = values.get(key)
        if place and _inside(place if key == "backup_dir" else os.path.dirname(place),
                             [root, *values.get("declared_paths", ())]):
            raise PolicyError(sources[key], f"{place} lies in the project or a declared path, which the agent can "
                              f"write: root's {'trail' if key == 'audit_log_path' else 'backups'} would be its",
                              f"give {FLAGS[key]} outside the project")
    values["config_files"] = (os.path.abspath(dot_path), os.path.join(root, "agentcell.toml"))
    cfg = replace(cfg, **values, sources=sources)
    wanted = (*(secret_names or PROFILES[cfg.harness].secret_env), *cfg.keep_env)
    notes = [f"--keep-env {k}: not set in the environment nor in {dot_path}: not passed" for k in cfg.keep_env
             if not env_view.get(k)]
    left = sorted(k for k in dot if k not in ENV_NAMES and k not in wanted)
    if left:  # never passed on a file's word alone: say so, and how
        notes.append(f"{dot_path}: {', '.join(left)} {'is' if len(left) == 1 else 'are'} not passed to the agent "
                     f"(only {cfg.harness}'s API keys are); --keep-env NAME passes one")
    return replace(cfg, secrets={k: env_view[k] for k in wanted if env_view.get(k)}, notes=tuple(notes))


def _project_file(where: str, toml_where: str, dot_ours: bool) -> bool:
    """Whether a value came from a file in the project (its ``agentcell.toml``, a ``.env`` that is not
    yours alone): the agent may have written it."""
    return where.startswith(toml_where) or (" (in " in where and not dot_ours)
