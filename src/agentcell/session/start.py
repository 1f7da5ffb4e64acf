"""``session start`` before and around the graph: the request checked, planned and compiled before
anything exists (a bad flag or value is refused before a backup or an account is made), the keys the
proxy injects, then the graph run to the session's end with the plan and the policy handed in."""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from ..errors import AgentcellError
from .report import PROG, shown, summary
from .request import StartRequest, checked_id, new_session_id


@dataclass(frozen=True)
class Prepared:
    """A session about to start: everything that could refuse its input has run; nothing exists yet but
    the summary file."""

    request: StartRequest
    config: Any  # config.SessionConfig, without the values of the keys the proxy injects
    session_id: str
    launch: Any  # harness.profiles.Launch
    plan: Any  # policy.models.SessionPlan
    marks: dict[str, str | None]  # the session's configuration files in the declared paths (planning.config_files)
    policy: dict[str, Any]  # the plan compiled, as state (secret values are placeholders)
    credentials: Any  # network.credentials.CredentialSet: the keys the proxy injects, or None
    upstream_ca: str | None
    summary_fd: int | None


def prepare(req: StartRequest) -> Prepared:
    from ..harness import profiles, seed
    from . import config
    from .planning import compile_policy, make_plan, session_network

    summary_fd = new_file(req.summary_file, "--summary-file") if req.summary_file else None
    cfg = config.load(req.flags(), dotenv=req.env_file)
    check_ceilings(cfg)
    check_witness(cfg)
    sid = checked_id(req.session_id, "--id") if req.session_id is not None else new_session_id()
    launch = profiles.launch(profiles.get(cfg.harness), cfg.harness_args, seed_dir=seed.path(sid),
                             api_base=cfg.api_base, model=cfg.model, secrets=tuple(cfg.secrets),
                             home_from=cfg.home_from is not None,
                             network=session_network(cfg.as_dict()))  # a missing harness: refused here
    if launch.renames:  # the names the cell knows them by
        from dataclasses import replace

        cfg = replace(cfg, secrets={launch.renames.get(k, k): v for k, v in cfg.secrets.items()})

    plan, marks = make_plan(cfg.as_dict(), sid, launch.as_dict())  # bad input is refused here, before a session exists
    if req.env_file and any(w.endswith(f"(in {req.env_file})") for k, w in cfg.sources.items()
                            if k in config.HOST_KEYS or k == "declared_paths"):
        check_env_file_untouched(req.env_file)
    try:
        policy = compile_policy(plan, dict(os.environ), cfg.project_root)
    except Exception:
        # The plan's egress is the flags' and the harness's: a flag it refuses is named as the user gave it.
        _check_egress_flags(cfg, plan.network)
        raise
    # The harness's keys the proxy injects (the cell holds placeholders), and those that enter as they are.
    creds, upstream_ca, cfg = credentials(req, cfg, launch, policy)
    return Prepared(req, cfg, sid, launch, plan, marks, policy, creds, upstream_ca, summary_fd)


def _check_egress_flags(cfg: Any, network: str) -> None:
    from ..network import compile as nc

    nc.egress(network, allow_domains=list(cfg.allow_domains), deny_domains=list(cfg.deny_domains),
              allow_presets=list(cfg.allow_presets), allow_ranges=list(cfg.allow_ranges), resolver=cfg.resolver,
              allow_egress=[], allow_loopback=False, names=nc.FLAGS)


def run(p: Prepared) -> dict[str, Any]:
    """The session, from its plan to its audit: its summary (:func:`.report.summary`)."""
    from ..policy.models import SandboxPolicy
    from . import graph, state
    from .config import SessionConfig
    from .planning import compile_policy
    from .records import Launch, record

    cfg, launch, sid = p.config, p.launch, p.session_id
    for note in (*cfg.notes, *launch.notes):
        sys.stderr.write(shown(f"{PROG}: note: {note}") + "\n")
    faults = state.parse_faults(os.environ.get(state.FAULTS_ENV, ""))
    # A harness that may own the terminal (its TUI, a shell) gets it alone: no status line over it.
    rt = state.Runtime(faults=faults, secrets=dict(cfg.secrets), credentials=p.credentials,
                       upstream_ca=p.upstream_ca, environ=dict(os.environ),
                       status_line=sys.stderr.isatty() and not p.request.json and not launch.interactive)
    g, _conn = graph.open_graph(rt)
    if p.request.session_id is not None and graph.load(g, sid) is not None:
        raise AgentcellError("--id", f"session {sid} exists", "give an id not used before")

    def stop(sig: int, _frame: object) -> None:
        rt.stop_requested[sid] = f"signal {sig}"

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, stop)
    sys.stderr.write(f"{PROG}: session {sid}: {cfg.harness} in {cfg.project_root}\n")
    seal_trail(cfg)
    plan, policy = p.plan, p.policy
    if list(plan.keep_env) != sorted(cfg.secrets):  # the keys the proxy injects are not passed through
        plan = plan.model_copy(update={"keep_env": sorted(cfg.secrets)})
        policy = compile_policy(plan, dict(os.environ), cfg.project_root)
    final = graph.run(g, {"session_id": sid, "config": record(SessionConfig, cfg.as_dict()), "argv": launch.argv,
                          "launch": record(Launch, launch.as_dict()), "plan": plan, "config_marks": p.marks,
                          "policy": record(SandboxPolicy, policy)})
    return summary(dict(final))


def check_witness(cfg: Any) -> None:
    """A trail sealed to one witness is not sealed to another (its heads form one chain there); and a
    session that requires a witness has one: given, or the trail's."""
    from ..audit import seal
    from ..audit.trail import AuditLog
    from ..errors import PolicyError

    path = AuditLog(cfg.audit_log_path).path
    try:
        st = seal.status(path)
    except OSError as e:
        raise AgentcellError("--audit-log", f"cannot read the seal of {path} ({e.strerror})",
                             "run through sudo (the trail is root's), or give a trail of yours") from None
    if st is not None and cfg.audit_witness and st.witness != cfg.audit_witness:
        raise PolicyError(cfg.sources["audit_witness"], f"{path} is sealed to {st.witness}, not {cfg.audit_witness}",
                          f"give {st.witness}, or leave it out: a sealed trail goes on sealing to its witness")
    if st is None and not cfg.audit_witness and cfg.audit_witness_required:
        raise PolicyError("--audit-witness-required", f"{path} is not sealed to a witness",
                          "add --audit-witness W (or seal the trail once: 'agentcell audit init --witness W')")


def seal_trail(cfg: Any) -> None:
    """Before the session's first record: seal its trail to ``--audit-witness`` if it is not sealed yet
    (the key is printed once, here); with ``--audit-witness-required``, the witness must take every head
    the trail has, or nothing starts."""
    from ..audit import seal
    from ..audit.trail import AuditLog

    log = AuditLog(cfg.audit_log_path)
    problem = None
    if cfg.audit_witness and not seal.is_sealed(log.path):
        key, problem = log.seal_to(cfg.audit_witness, seal.DEFAULT_EVERY, seal.DEFAULT_INTERVAL_S)
        sys.stderr.write(f"{PROG}: the audit trail {log.path} is now sealed to {cfg.audit_witness}; its key, which "
                         f"'agentcell audit verify --witness W --key KEY' needs (keep it off this host): {key}\n")
    elif cfg.audit_witness_required:
        problem = log.seal()
    if problem and cfg.audit_witness_required:
        raise AgentcellError("--audit-witness-required", problem, "start the witness (or leave out "
                             "--audit-witness-required); the heads wait on this host until it takes them")
    if problem:
        sys.stderr.write(shown(f"{PROG}: warning: {problem}; the heads wait on this host") + "\n")


def check_ceilings(cfg: Any) -> None:
    """Fail closed: a session without root gets its ceilings from a cgroup delegated to its user, or runs
    without them only when told (--ceilings off); never a silent demotion."""
    from ..cell import cgroups

    if os.geteuid() == 0 or not any(cfg.limits) or cgroups.delegated() is not None:
        return
    raise AgentcellError("--ceilings", f"the session's ceilings ({cfg.sources.get('limits')}) need a cgroup, and none "
                         "is delegated to you here", "give --ceilings off to run without them (the audit trail and "
                         f"the summary say so), or {cgroups.how_to_delegate()}")


def credentials(req: StartRequest, cfg: Any, launch: Any, policy: dict[str, Any]) -> tuple[Any, str | None, Any]:
    """(the keys the proxy injects, the upstream CA's PEM, the configuration without those keys' values).
    With the proxy, each of the harness's keys that has a home (its provider, --api-base's host) is bound
    there, to the hosts of it the allow-list lets through; the cell gets a placeholder. Without the proxy
    the keys enter the cell as they are (said in a note)."""
    from dataclasses import replace

    from ..harness import profiles

    pem = None
    if req.upstream_ca:
        from ..network.tlsca import read_bundle

        pem = read_bundle(req.upstream_ca, "--upstream-ca")
    given = given_secrets(req, policy)
    if not cfg.secrets and not given:
        return None, pem, cfg
    back = {cell: host for host, cell in launch.renames.items()}  # (cfg.secrets are by their names in the cell)
    renamed = {k: back.get(k, k) for k in cfg.secrets}  # name in the cell -> name on the host
    bound = profiles.key_bindings(profiles.get(cfg.harness), tuple(renamed.values()), cfg.api_base)
    if policy.get("network") != "proxy":
        if bound:
            names = ", ".join(sorted(renamed[k] for k in bound))
            notes = (*cfg.notes, f"{names} enter the cell as they are: the proxy keeps keys out of the cell "
                     "(--net proxy)")
            cfg = replace(cfg, notes=notes)
        return None, pem, cfg
    from ..network.credentials import CredentialSet
    from ..network.rules import Policy

    rules = Policy.from_rules(policy.get("egress") or ())
    gateway = launch.api_host.rsplit(":", 1)[0] if launch.api_host else None  # (on the allow-list at its port)
    allowed = {k: (tuple(h for h in hosts if h.removeprefix("http://") == gateway or rules.name_verdict(h, 443)[0]),
                   headers) for k, (hosts, headers) in bound.items()}
    allowed = {k: v for k, v in allowed.items() if v[0] and k not in given}
    values = {**{k: cfg.secrets[k] for k in allowed}, **{k: v for k, (v, _) in given.items()}}
    if not values:
        return None, pem, cfg
    creds = CredentialSet.build(values, {**allowed, **{k: b for k, (_, b) in given.items()}})
    return creds, pem, replace(cfg, secrets={k: v for k, v in cfg.secrets.items() if k not in values})


def given_secrets(req: StartRequest, policy: dict[str, Any]
                  ) -> dict[str, tuple[str, tuple[tuple[str, ...], tuple[str, ...]]]]:
    """``--secret``/``--secret-host``: name -> (value, (hosts, headers)). Read on the host now (a ``cmd:``
    source as the person who ran sudo); each bound host must be on the session's allow-list."""
    if not req.secret:
        if req.secret_host:
            raise AgentcellError("--secret-host", "says where a --secret goes", "add --secret NAME")
        return {}
    if policy.get("network") != "proxy":
        raise AgentcellError("--secret", "credentials are injected by the egress proxy", "use --net proxy")
    from ..network.credentials import off_the_list, parse_bindings, read_values
    from ..network.rules import Policy

    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    person = (int(uid), int(gid or uid)) if uid.isdigit() and uid != "0" and (gid or uid).isdigit() else None
    values = read_values(req.secret, run_as=person)
    bindings = parse_bindings(req.secret_host or [])
    rules = Policy.from_rules(policy.get("egress") or ())
    out = {}
    for name, value in values.items():
        hosts, headers = bindings.get(name, ((), ()))
        if not hosts:
            raise AgentcellError("--secret", f"{name} is bound to no host", f"add --secret-host {name}=HOST")
        off = off_the_list(hosts, rules.name_verdict)
        if off is not None:
            raise AgentcellError("--secret-host", f"{off} is not on the allow-list",
                                 f"add --allow-domain {off.removeprefix('http://')}")
        out[name] = (value, (hosts, headers))
    for name in bindings:
        if name not in values:
            raise AgentcellError("--secret-host", f"{name} is bound but not given", f"add --secret {name}")
    return out


def new_file(path: str, field: str) -> int:
    """A file made for us now (never one that exists, never through a link), mode 0600."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise AgentcellError(field, f"cannot make {path}: {e.strerror}", "give a new file's path") from None


def check_env_file_untouched(path: str) -> None:
    """An --env-file that decides where root writes must not lie where an earlier session's agent
    could write (its project, its declared paths): a root-owned file the agent rewrote through its
    grant and renamed there looks like root's own once the grant is gone. Checked against the
    sessions this state dir records."""
    from . import graph, state

    real = os.path.realpath(path)
    ancestors: dict[tuple[int, int], str] = {}  # by identity too: a former project renamed since
    d = os.path.dirname(real)
    while True:
        try:
            dst = os.stat(d)
            ancestors[(dst.st_dev, dst.st_ino)] = d
        except OSError:
            pass
        if d == os.path.dirname(d):
            break
        d = os.path.dirname(d)
    g, conn = graph.open_graph()
    try:
        for sid in graph.session_ids(conn):
            st = graph.load(g, sid) or {}
            cfg, policy = state.config_of(st), state.policy_of(st)
            places = [cfg.project_root, *cfg.declared_paths, *(policy.rw_paths if policy else ())]
            hit = next((place for place in (os.path.realpath(p) for p in places if p)
                        if real == place or real.startswith(place.rstrip("/") + "/")), None)
            hit = hit or next((ancestors[(i[0], i[1])] for i in st.get("root_ids") or []
                               if len(i) == 2 and (i[0], i[1]) in ancestors), None)
            if hit is not None:
                raise AgentcellError("--env-file", f"{path} lies in {hit}, where the agent of session {sid} "
                                     "could write", "keep the file where no agent has worked, or give the "
                                     "values as flags")
    finally:
        conn.close()
