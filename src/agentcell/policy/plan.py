"""What a cell asks for, as plain data, and the one compiler that turns it into a :class:`CellSpec`.

``agentcell run``'s flags fill a :class:`Plan` (:mod:`agentcell.cli.runargs`); a session's
:class:`~agentcell.policy.models.SessionPlan` becomes one too (:mod:`agentcell.policy.compile`). Both are
compiled by :func:`compile_spec`, so a path, an identity, an environment or an egress rule is refused by
the same rule whichever way it was asked for. A plan carries its :class:`Terms`: the words its user gave
it in (``--rw`` on the command line, ``declared_paths`` in a plan), so each refusal names the user's own.

Standard library only, and none of its slow parts: this is on ``agentcell run``'s path.
"""
from __future__ import annotations

import os

from ..cell.spec import TYPE_CHECKING, CellSpec, Identity, _Frozen, new_cell_id
from ..errors import PolicyError
from . import resolve as rs

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping

    from ..cell.spec import LandlockMode, NetworkMode


class Terms(_Frozen):
    """How a plan's user names its fields. ``names``: field -> flag or key; ``words``: what resolve.py
    says in flags, said in these terms instead; the rest: sentences that differ by more than a name."""

    __slots__ = ("names", "words", "rootless_firewall", "outside_rw")
    names: Mapping[str, str]
    words: tuple[tuple[str, str], ...]
    rootless_firewall: tuple[str, str]
    outside_rw: str

    def __init__(self, names: Mapping[str, str], words: tuple[tuple[str, str], ...],
                 rootless_firewall: tuple[str, str], outside_rw: str) -> None:
        self._init(names=names, words=words, rootless_firewall=rootless_firewall, outside_rw=outside_rw)

    def __getitem__(self, field: str) -> str:
        return self.names.get(field, field)


# The egress fields' names are network/compile.py's (FLAGS, PLAN), which says the same to the proxy's rules.
FLAGS = Terms(
    {"identity": "--as", "declared_paths": "--rw", "ro_paths": "--ro", "masked_paths": "--mask",
     "scratch": "--scratch", "home": "--home", "env": "--env", "keep_env": "--keep-env",
     "allow_write": "--allow-write", "cwd": "--cwd", "network": "--net"},
    (),
    ("host-firewall rules key on an account's uid, and a rootless cell has none of its own",
     "run through sudo with --as, or use --net proxy"),
    "share its project with --rw")
PLAN = Terms(
    {},
    ((rs.UNSAFE_FLAG, "allow_unsafe_paths = true"), ("--as ", "identity = "), ("--keep-env ", "keep_env = "),
     ("--env ", "env ")),
    ("host-firewall rules key on an account's uid; identity 'self' has none",
     "use identity = agent:NAME, or network = proxy"),
    "declare its project")


class Plan(_Frozen):
    """A cell's request before anything is resolved or refused. Paths may be relative (to the
    ``host_cwd`` the compiler is given) or start with ``~``; every sequence is a tuple."""

    __slots__ = ("identity", "declared_paths", "ro_paths", "masked_paths", "excluded_paths", "scratch", "home",
                 "home_persistent", "agent_home", "allow_unsafe_paths", "cwd", "env", "keep_env", "allow_write",
                 "network", "allow_domains", "deny_domains", "allow_presets", "allow_ranges", "resolver",
                 "allow_egress", "allow_loopback", "landlock", "landlock_min_abi", "memory_max", "cpu_percent",
                 "pids_max", "watch", "cell_id", "terms")
    identity: str | None  # self (None), agent:NAME or a uid
    declared_paths: tuple[str, ...]  # shared read-write
    ro_paths: tuple[str, ...]
    masked_paths: tuple[str, ...]
    excluded_paths: tuple[str, ...]  # inside a declared path; masked
    scratch: str | None  # host dir behind /scratch; None: a private tmpfs
    home: str | None  # host dir behind $HOME; None: a private tmpfs
    home_persistent: bool  # an agent account's own home behind $HOME
    agent_home: str | None  # an agent account's own home, which ``home`` may name though it is a home
    allow_unsafe_paths: bool
    cwd: str | None  # the cell's working directory, if given; else the host's where the cell sees it
    env: tuple[str, ...]  # NAME=VALUE
    keep_env: tuple[str, ...]
    allow_write: tuple[str, ...]  # protected paths the command may write
    network: NetworkMode
    allow_domains: tuple[str, ...]
    deny_domains: tuple[str, ...]
    allow_presets: tuple[str, ...]
    allow_ranges: tuple[str, ...]
    resolver: str | None
    allow_egress: tuple[str, ...]
    allow_loopback: bool
    landlock: LandlockMode
    landlock_min_abi: int
    memory_max: int | None
    cpu_percent: int | None
    pids_max: int | None
    watch: bool
    cell_id: str  # "": a new one
    terms: Terms

    def __init__(self, *, identity: str | None = None, declared_paths: Iterable[str] = (),
                 ro_paths: Iterable[str] = (), masked_paths: Iterable[str] = (), excluded_paths: Iterable[str] = (),
                 scratch: str | None = None, home: str | None = None, home_persistent: bool = False,
                 agent_home: str | None = None, allow_unsafe_paths: bool = False, cwd: str | None = None,
                 env: Iterable[str] = (), keep_env: Iterable[str] = (), allow_write: Iterable[str] = (),
                 network: NetworkMode = "none", allow_domains: Iterable[str] = (), deny_domains: Iterable[str] = (),
                 allow_presets: Iterable[str] = (), allow_ranges: Iterable[str] = (), resolver: str | None = None,
                 allow_egress: Iterable[str] = (), allow_loopback: bool = False, landlock: LandlockMode = "required",
                 landlock_min_abi: int = 1, memory_max: int | None = None, cpu_percent: int | None = None,
                 pids_max: int | None = None, watch: bool = False, cell_id: str = "", terms: Terms = FLAGS) -> None:
        self._init(identity=identity, declared_paths=tuple(declared_paths), ro_paths=tuple(ro_paths),
                   masked_paths=tuple(masked_paths), excluded_paths=tuple(excluded_paths), scratch=scratch,
                   home=home, home_persistent=bool(home_persistent), agent_home=agent_home,
                   allow_unsafe_paths=bool(allow_unsafe_paths), cwd=cwd, env=tuple(env), keep_env=tuple(keep_env),
                   allow_write=tuple(allow_write), network=network, allow_domains=tuple(allow_domains),
                   deny_domains=tuple(deny_domains), allow_presets=tuple(allow_presets),
                   allow_ranges=tuple(allow_ranges), resolver=resolver, allow_egress=tuple(allow_egress),
                   allow_loopback=bool(allow_loopback), landlock=landlock, landlock_min_abi=landlock_min_abi,
                   memory_max=memory_max, cpu_percent=cpu_percent, pids_max=pids_max, watch=bool(watch),
                   cell_id=cell_id, terms=terms)


class _InTerms:
    """Re-raise resolve.py's refusals (worded in flags) in the plan's terms."""

    def __init__(self, terms: Terms) -> None:
        self.terms = terms

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, e: BaseException | None, _tb: object) -> None:
        if not isinstance(e, PolicyError) or not self.terms.words:
            return
        problem, fix = e.problem, e.fix
        for flag, key in self.terms.words:
            problem, fix = problem.replace(flag, key), fix.replace(flag, key)
        field = {"--as": "identity", "--env": "env", "--keep-env": "keep_env"}.get(e.field, e.field)
        raise PolicyError(self.terms[field], problem, fix) from None


def compile_spec(plan: Plan, *, environ: Mapping[str, str], euid: int | None = None,
                 host_cwd: str | None = None) -> CellSpec:
    """Resolve and check everything ``plan`` asks for; refuse with one :class:`PolicyError` naming the
    field in the plan's terms. ``environ`` and ``euid``: the invoking user's (``euid`` defaults to the
    process's). ``host_cwd``: where the caller is; it anchors relative paths and is the cell's working
    directory where the cell sees it. Without it relative paths are refused and the cell starts in the
    first declared path (else the first ro path, else its home)."""
    t, in_terms = plan.terms, _InTerms(plan.terms)
    with in_terms:
        ident = rs.resolve_identity(plan.identity, euid=euid, environ=environ)
    if plan.network == "host-firewall" and ident.userns:
        raise PolicyError(t["network"], *t.rootless_firewall)
    given = (plan.declared_paths, plan.ro_paths, plan.masked_paths, plan.excluded_paths, plan.allow_write)
    homes = rs.home_dirs() if any(given) or plan.scratch or plan.home else set()
    unsafe = plan.allow_unsafe_paths

    def paths(key: str, items: Iterable[str], *, writable: bool, allow_unsafe: bool) -> tuple[str, ...]:
        absolute = [anchor(p, host_cwd, t[key]) for p in items]
        with in_terms:
            return rs.resolve_paths(absolute, field=t[key], writable=writable, allow_unsafe=allow_unsafe,
                                    homes=homes)

    rw = paths("declared_paths", plan.declared_paths, writable=True, allow_unsafe=unsafe)
    ro = paths("ro_paths", plan.ro_paths, writable=False, allow_unsafe=unsafe)
    # Hiding a path never opens the host, so masks need no override.
    masked = paths("masked_paths", plan.masked_paths, writable=False, allow_unsafe=True)
    rs.check_masks(masked, t["masked_paths"])
    excluded = paths("excluded_paths", plan.excluded_paths, writable=False, allow_unsafe=True)
    for p in excluded:
        if p in rw:
            raise PolicyError(t["excluded_paths"], f"{p} is itself a declared path",
                              f"remove it from {t['declared_paths']} instead")
        if not any(p.startswith(d.rstrip("/") + "/") for d in rw):
            raise PolicyError(t["excluded_paths"], f"{p} is not inside any declared path",
                              f"exclude paths inside {t['declared_paths']}; hide others with {t['masked_paths']}")
    masked += tuple(p for p in excluded if p not in masked)
    scratch = paths("scratch", [plan.scratch], writable=True, allow_unsafe=unsafe) if plan.scratch else ()
    # An agent account's own home is its $HOME (agentcell agent run names it; no flag can).
    own = plan.agent_home is not None and plan.agent_home == plan.home
    home = paths("home", [plan.home], writable=True, allow_unsafe=unsafe or own) if plan.home else ()
    if plan.home_persistent:
        home = (_own_home(ident),)
    rs.check_disjoint({t["declared_paths"]: rw, t["ro_paths"]: ro, t["masked_paths"]: masked,
                       t["scratch"]: scratch, t["home"]: home})
    with in_terms:
        env = rs.build_env(environ, ident, plan.env, plan.keep_env)
    cwd = _cwd(plan, host_cwd, (*rw, *ro), ident)
    given_writes = [p if host_cwd is None else anchor(p, host_cwd, "") for p in plan.allow_write]
    allowed = rs.allowed_writes(given_writes, rw, field=t["allow_write"], homes=homes, fix=t.outside_rw)
    return CellSpec(
        ident, rw_paths=rw, ro_paths=ro, masked_paths=masked, scratch_dir=scratch[0] if scratch else None,
        home_dir=home[0] if home else None, network=plan.network, egress=egress(plan), env=env, cwd=cwd,
        landlock=plan.landlock,
        # In the host's network the host's abstract unix sockets (X11, D-Bus, ...) are reachable but for
        # Landlock's scope, which needs ABI 6: below it such a cell fails closed.
        landlock_min_abi=max(plan.landlock_min_abi, 6) if plan.network == "host-firewall" else plan.landlock_min_abi,
        memory_max=plan.memory_max, cpu_percent=plan.cpu_percent, pids_max=plan.pids_max, allow_write=allowed,
        watch=plan.watch, cell_id=plan.cell_id or new_cell_id())


def _cwd(plan: Plan, host_cwd: str | None, visible: tuple[str, ...], ident: Identity) -> str:
    if plan.cwd:
        cwd = os.path.realpath(plan.cwd)
        if rs.cell_cwd(cwd, (*visible, ident.home), "") != cwd:
            raise PolicyError(plan.terms["cwd"], f"{plan.cwd} is not visible in the cell", "share it with "
                              f"{plan.terms['declared_paths']} or {plan.terms['ro_paths']}")
        return cwd
    if host_cwd is not None:
        return rs.cell_cwd(os.path.realpath(host_cwd), visible, ident.home)
    return (*visible, ident.home)[0]


def egress(plan: Plan) -> tuple[str, ...]:
    """The proxy's or the firewall's rules as text, checked now (one line, before anything runs)."""
    if plan.network in ("none", "loopback") and not any(_egress_fields(plan)):
        return ()  # agentcell run's usual path: nothing to import
    from ..network import compile as nc

    names = nc.FLAGS if plan.terms is FLAGS else nc.PLAN
    return nc.egress(plan.network, allow_domains=list(plan.allow_domains), deny_domains=list(plan.deny_domains),
                     allow_presets=list(plan.allow_presets), allow_ranges=list(plan.allow_ranges),
                     resolver=plan.resolver, allow_egress=list(plan.allow_egress), allow_loopback=plan.allow_loopback,
                     names=names)


def _egress_fields(plan: Plan) -> Iterator[object]:
    yield from (plan.allow_domains, plan.deny_domains, plan.allow_presets, plan.allow_ranges, plan.resolver,
                plan.allow_egress, plan.allow_loopback)


def anchor(path: str, base: str | None, field: str) -> str:
    """``path`` made absolute from ``base``; refused if relative with no base."""
    if not path or os.path.isabs(path) or path.startswith("~"):
        return path  # resolve_path refuses the empty path and expands ~
    if base is None:
        raise PolicyError(field, f"{path} is relative and there is no directory to anchor it",
                          "give an absolute path")
    return os.path.join(base, path)


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
