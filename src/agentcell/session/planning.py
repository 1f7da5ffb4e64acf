"""A session's plan and its policy, from its configuration and its harness's launch: pure, so that bad
input is refused before anything exists (``session start`` runs them before the graph, and hands their
result in; the graph's first nodes work them out only for a caller that did not)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..errors import PolicyError
from . import envfiles
from .records import SECRET_PLACEHOLDER

if TYPE_CHECKING:
    from ..policy.models import SessionPlan


def ids(paths: list[str]) -> list[list[int]]:
    """Device and inode of each path that exists: a directory renamed since is still recognised."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append([st.st_dev, st.st_ino])
    return out


def session_human(project_root: str) -> list[int]:
    """Who gets what a per-session account made: the human behind sudo, else the project's owner;
    never root. A file the agent wrote must not become root's, which other tools (and agentcell's own
    configuration) take for the administrator's word."""
    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    if uid.isdigit() and gid.isdigit() and int(uid) != 0:
        return [int(uid), int(gid)]
    st = os.stat(project_root)
    if st.st_uid == 0:
        raise PolicyError("project_root", f"{project_root} is root's, and no one ran this session through sudo: "
                          "what the agent makes would become root's",
                          "run it with sudo as the person who works on the project, or chown the project to them")
    return [st.st_uid, st.st_gid]


def _address(host_port: str) -> Any:
    import ipaddress

    host = host_port.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def session_network(cfg: dict[str, Any]) -> str:
    """The network a configuration gets: --net, else host-firewall with FIREWALL_ENABLED, else the proxy
    when it names domains (or a model API), else the harness's own."""
    from ..harness import profiles

    domain_rules = any(cfg.get(k) for k in ("allow_domains", "deny_domains", "allow_presets", "allow_ranges",
                                            "resolver"))
    return str(cfg.get("network") or ("host-firewall" if cfg.get("firewall_enabled") else
                                      "proxy" if domain_rules else profiles.get(cfg["harness"]).network))


def make_plan(cfg: dict[str, Any], session_id: str, launch: dict[str, Any] | None = None
              ) -> tuple[SessionPlan, dict[str, str | None]]:
    """The plan of a session from its configuration and its harness's launch (the profile's env,
    the cell's PATH, the model API's host: :func:`agentcell.harness.profiles.launch`; without one,
    the profile's env alone)."""
    from ..accounts import ephemeral
    from ..harness import profiles
    from ..policy.models import Limits, SessionPlan

    prof = profiles.get(cfg["harness"])
    launch = launch or {}
    network = session_network(cfg)
    api_host = launch.get("api_host")
    if api_host and network in ("none", "loopback"):
        raise PolicyError(cfg.get("sources", {}).get("network", "network"), f"--api-base needs a way out, and the "
                          f"network is {network}", "leave --net out (the harness's proxy) or give --net proxy")
    if api_host and _address(api_host) is not None:  # the proxy reaches an address only through a range
        import ipaddress

        addr = _address(api_host)

        def covers(r: str) -> bool:
            try:
                return addr in ipaddress.ip_network(r, strict=False)
            except ValueError:  # refused with its own message when the egress rules are checked
                return False

        if not any(covers(r) for r in cfg.get("allow_ranges") or []):
            raise PolicyError("--api-base", f"{api_host} is an address: the proxy reaches one only in a range you "
                              "allow", f"add --allow-range {addr}/{32 if addr.version == 4 else 128} (every port of "
                              "it), or give the server's name")
        api_host = None
    if os.geteuid() != 0:
        identity = "self"
    elif cfg.get("agent"):
        identity = f"agent:{cfg['agent']}"
    else:  # the per-session account does not exist yet: checked against a uid of its range
        identity = str(ephemeral.UID_FIRST)
        session_human(cfg["project_root"])  # refused now, before anything exists
    declared = list(cfg.get("declared_paths") or [cfg["project_root"]])
    ro, masked, marks = config_files(cfg.get("config_files", []), declared)
    env = dict(launch.get("env") or prof.env)
    if launch.get("path"):
        env["PATH"] = launch["path"]
    env.update(dict(cfg.get("env") or []))  # the user's --env wins over the profile
    memory, cpu, pids = (cfg.get("limits") or [None, None, None])
    plan = SessionPlan(
        session_id=session_id, harness=cfg["harness"], declared_paths=declared, ro_paths=ro, masked_paths=masked,
        wall_clock_limit_s=cfg["wall_clock_limit_s"], network=network,  # type: ignore[arg-type]
        identity=identity, env=env, keep_env=sorted(cfg.get("secret_names") or []),
        risk=cfg.get("risk") or "medium", limits=Limits(memory_bytes=memory, cpu_percent=cpu, pids=pids),
        home_persistent=bool(cfg.get("agent")) and os.geteuid() == 0,
        allow_presets=[*([prof.egress_preset] if network == "proxy" and prof.egress_preset else []),
                       *cfg.get("allow_presets", [])],
        allow_domains=[*cfg.get("allow_domains", []), *([api_host] if api_host and network == "proxy" else [])],
        deny_domains=list(cfg.get("deny_domains", [])),
        allow_ranges=list(cfg.get("allow_ranges", [])), resolver=cfg.get("resolver"),
        allow_egress=["seed"] if network == "host-firewall" else [])
    return plan, marks


def compile_policy(plan: SessionPlan, environ: dict[str, str], project_root: str,
                   identity: str | None = None) -> dict[str, Any]:
    """The policy, as state: secrets are placeholders (filled in at spawn, never checkpointed)."""
    from ..policy.compile import compile_plan

    if identity is not None:
        plan = plan.model_copy(update={"identity": identity})
    env = {k: v for k, v in environ.items() if k in ("LANG", "TERM") or k.startswith("LC_")}
    env.update({k: SECRET_PLACEHOLDER for k in plan.keep_env})
    return compile_plan(plan, environ=env, host_cwd=project_root).model_dump()


# ---- the session's own configuration inside the project -------------------------------------------

def config_files(files: list[str], declared: list[str]) -> tuple[list[str], list[str], dict[str, str | None]]:
    """The agent must not change what configures its next session, nor read the secrets in ``.env``: an
    ``agentcell.toml`` inside a declared path is bound read-only, a ``.env`` there is hidden. One that
    does not exist yet cannot be bound: cleanup warns if the agent created it."""
    roots = [os.path.realpath(d) for d in declared]
    ro: list[str] = []
    masked: list[str] = []
    marks: dict[str, str | None] = {}
    for f in files:
        parent = os.path.realpath(os.path.dirname(f))
        if not any(parent == r or parent.startswith(r.rstrip("/") + "/") for r in roots):
            continue
        marks[f] = envfiles.fingerprint(f)
        if marks[f] is not None:  # the env file the session read (whatever its name) is hidden, the toml read-only
            (ro if os.path.basename(f) == "agentcell.toml" else masked).append(f)
    found, stopped = envfiles.dotenv_files(declared)
    masked += [f for f in found if f not in masked]
    if stopped is not None:
        raise PolicyError("declared_paths", f"the search for .env files in {', '.join(declared)} stopped after "
                          f"{envfiles.MAX_ENV_DIRS:,} directories, at {stopped}: one past it would not be hidden from "
                          "the agent",
                          "declare narrower paths with --rw, or remove what fills them")
    return ro, masked, marks

