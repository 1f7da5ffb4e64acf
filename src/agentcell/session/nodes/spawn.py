"""spawn: the cell, with what the session adds to its policy's spec — the secrets, the copy-on-write
workspace, the cell's own git configuration, the seed directory, the toolchain caches — and the scan of
the control surface that cleanup compares against."""
from __future__ import annotations

import os
import shutil
import time
from typing import Any

from ... import caches, hostfs
from ...cell.spec import DEFAULT_PATH
from ...errors import AgentcellError, mark_after_go
from .. import envfiles, gitcell
from ..records import SECRET_PLACEHOLDER, Launch, Surface, of
from ..state import Runtime, SessionState, config_of, policy_of
from .kit import SpawnCrash, audit, crash, inject, line, written_paths


def spawn(rt: Runtime, state: SessionState) -> dict[str, Any]:
    from ...protect import surface
    from .. import spawn

    inject(rt, "spawn", SpawnCrash)
    sid = state["session_id"]
    policy = policy_of(state)
    assert policy is not None  # (the policy node ran)
    spec = policy.to_cell_spec()
    env = tuple((k, rt.secrets.get(k, "") if v == SECRET_PLACEHOLDER else v) for k, v in spec.env)
    spec = spec.replace(env=env)
    # What is there now of what git, shells and harnesses read (hooks, .envrc, CLAUDE.md, …): cleanup
    # moves aside what the agent creates there, as agentcell run does.
    since_ns = time.time_ns() - 100_000_000  # file times are coarse: some slack
    written = tuple(written_paths(state))
    before, truncated = surface.surface(written)
    env_files = envfiles.dotenv_files(list(written))[0]  # (what exists is hidden in the cell; see cleanup)
    ws_dir = None
    if config_of(state).workspace == "copy":
        spec, ws_dir = _workspace(state, spec)
    git = _git(state, spec.rw_paths)
    ours = [("gitconfig", git["config"], False)]
    if git.get("wrapper"):
        ours.append(("bin/git", git["wrapper"], False))
    seed_dir, seed_notes = _seed(state, policy.identity.uid, policy.identity.gid, tuple(ours))
    if seed_dir is not None:
        cell_env = dict(spec.env)
        if git.get("wrapper"):  # the seed's git first (gitcell.wrapper)
            cell_env["PATH"] = os.path.join(seed_dir, "bin") + ":" + cell_env.get("PATH", DEFAULT_PATH)
        cell_env.update(gitcell.environment(os.path.join(seed_dir, "gitconfig"), git["name"], git["email"]))
        spec = spec.replace(ro_paths=(*spec.ro_paths, seed_dir), env=tuple(cell_env.items()))
    cache_dir, cache_notes = _cache(state, policy.identity.uid, policy.identity.gid)
    if cache_dir is not None:
        spec = spec.replace(cache_dir=cache_dir,
                            env=(*spec.env, *caches.environment(dict(spec.env)).items()))
    made = rt.firewalls.get(sid)
    protect = Surface(before, truncated, since_ns, surface.meanings(before), tuple(env_files))
    try:  # kept before the agent may go: a supervisor killed before this node's checkpoint loses no scan
        keep_surface(sid, protect)
    except OSError as e:
        raise SpawnCrash("", f"the protected-path scan could not be kept ({e.strerror or e})") from None
    try:
        cell = spawn.start(spec, list(state["argv"]), stdio=rt.stdio, firewall=made,
                           credentials=rt.credentials, upstream_ca=rt.upstream_ca, host=rt.host)
        if rt.fault("go@spawn"):  # (the test hook) a start that fails once the agent was let go: it ran meanwhile
            cell.wait(120)
            raise _failed_after_go()
    except (OSError, AgentcellError) as e:  # the table stays ours: a retry hands it over again, cleanup removes it
        if getattr(e, "after_go", False):  # the agent may have run: never started a second time
            err = AgentcellError("spawn", f"{line(e)} (after the agent was let go: not retried)")
            err.protect = protect  # type: ignore[attr-defined]  # (cleanup moves aside what it planted meanwhile)
            raise err from None
        forget_surface(sid)  # the agent never went: nothing of its to look for
        raise SpawnCrash("", line(e)) from None
    if made is not None:  # the cell's host owns the table now, and removes it with the cell
        rt.firewalls.pop(sid)
        made[1].close()
    pid1 = cell.pid1
    rt.cells[sid] = cell
    now = time.time()
    if rt.fault("ran@spawn"):  # (the test hook) the agent runs to its end, then the supervisor dies: no checkpoint
        cell.wait(120)
        crash(rt, "spawn", always=True)
    crash(rt, "spawn")
    audit(rt, state, "spawn", "session.spawn", cell_id=cell.cell_id, pid1=pid1, argv0=state["argv"][0],
          uid=policy.identity.uid, seed=seed_dir, home_from=config_of(state).home_from,
          git_identity=f"{git['name']} <{git['email']}>", git_identity_from=git["from"],
          git_safe_directories=git["safe"], cache=cache_dir, workspace=ws_dir)
    return {"harness_pid": pid1, "cell_id": cell.cell_id, "started_at": now, "cache_dir": cache_dir,
            "workspace_dir": ws_dir,
            "deadline": now + policy.wall_clock_limit_s, "seed_notes": [*seed_notes, *cache_notes],
            "protect": protect}


def _surface_file(sid: str) -> str:
    from ..state import sessions_dir

    return os.path.join(sessions_dir(), f"protect-{sid}.json")


KEPT_MAX = 64 << 20  # a kept scan's size, written and read (MAX_DIRS entries and their meanings fit well)


def keep_surface(sid: str, protect: Surface) -> None:
    """The scan cleanup compares against, in the state dir beside the checkpoints, before the agent may go:
    the spawn node's own checkpoint comes only once the cell has started. Durable (file and directory
    synced): a node that loses power after the agent went still has it. OSError if it cannot be kept."""
    import json

    from ...audit.base import fsync_dir
    from ..records import to_plain

    data = json.dumps(to_plain(protect)).encode()
    if len(data) > KEPT_MAX:
        raise OSError(27, f"the scan is {len(data):,} bytes, more than {KEPT_MAX:,}")
    path = _surface_file(sid)
    hostfs.replace_file(path, data)
    fsync_dir(os.path.dirname(path))


def kept_surface(sid: str) -> Surface | None:
    """The scan :func:`keep_surface` kept (for a session whose supervisor died before spawn's checkpoint);
    None if there is none (the agent never went). ValueError if it is damaged (not the scan as written)."""
    import json

    path = _surface_file(sid)
    if not os.path.lexists(path):
        return None
    try:
        data = json.loads(hostfs.read_regular(path, "protect", "nothing but agentcell writes the state dir",
                                              limit=KEPT_MAX))
        scan = of(Surface, data) if isinstance(data, dict) else None
    except Exception as e:  # noqa: BLE001 - whatever it holds: damaged, said so by the caller
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if scan is None or not _well_formed(scan):
        raise ValueError(f"{path} does not hold a scan as agentcell writes it")
    return scan


def _well_formed(s: Surface) -> bool:
    def strs(v: Any) -> bool:
        return all(isinstance(x, str) for x in v)

    return (isinstance(s.before, dict) and strs(s.before)
            and all(isinstance(v, (list, tuple)) and len(v) == 4 and all(type(x) is int for x in v)
                    for v in s.before.values())
            and type(s.truncated) is bool and type(s.since_ns) is int
            and (s.meanings is None or (isinstance(s.meanings, dict) and strs(s.meanings)
                                        and strs(s.meanings.values())))
            and isinstance(s.env_files, tuple) and strs(s.env_files))


def forget_surface(sid: str) -> None:
    """Remove the kept scan, if any (never raises: what is left is only read for this session's id)."""
    try:
        os.unlink(_surface_file(sid))
    except OSError:
        pass


def _failed_after_go() -> AgentcellError:
    e = AgentcellError("spawn", "injected fault once the agent was let go",
                       "unset go@spawn in the fault-injection hook")
    mark_after_go(e)
    return e


def _workspace(state: SessionState, spec: Any) -> tuple[Any, str]:
    """The project as a copy-on-write view (agentcell.workspace): made once; a retried spawn finds it."""
    from ... import workspace

    cfg, sid = config_of(state), state["session_id"]
    project = os.path.realpath(cfg.project_root)
    st = os.stat(project)
    human = state.get("human") or [st.st_uid, st.st_gid]
    include = list(cfg.workspace_include)
    # What the cell masks in the project is left out of the copy, but what the human names with
    # --workspace-include (their .env, say): that is theirs to give.
    inside = [m for m in spec.masked_paths if hostfs.within(m, project) and m != project
              and os.path.relpath(m, project) not in include]
    ws = workspace.create(sid, project, owner=(int(human[0]), int(human[1])),
                          account=(spec.identity.uid, spec.identity.gid), include=include, masked=inside,
                          trail=cfg.audit_log_path)
    # The copy is the whole project: declared paths inside it are in it; those outside stay as they are.
    rw = (project, *(p for p in spec.rw_paths if not hostfs.within(p, project)))
    spec = spec.replace(workspace=ws, rw_paths=rw, masked_paths=tuple(m for m in spec.masked_paths
                                                                      if not hostfs.within(m, project)))
    return spec, workspace.path_of(sid)


def _cache(state: SessionState, uid: int, gid: int) -> tuple[str | None, list[str]]:
    """The project's toolchain caches (:mod:`agentcell.caches`), handed to the session's account;
    none with --cache off. A store that cannot be used is said, and the session runs cold."""
    cfg = config_of(state)
    if not cfg.cache:
        return None, []
    try:
        tree, left = caches.prepare(cfg.project_root, cfg.agent, (uid, gid))
    except (OSError, AgentcellError) as e:
        return None, [f"toolchain caches: none this session ({line(e)})"]
    return tree, left


def _git(state: SessionState, rw_paths: tuple[str, ...]) -> dict[str, Any]:
    """The cell's own git configuration (:mod:`.gitcell`): the declared paths and the repositories in
    them as safe directories, the identity the agent commits under."""
    from ...protect import surface

    repos = surface.repositories(rw_paths)
    human = state.get("human")
    uid = human[0] if human else None if os.geteuid() == 0 else os.getuid()  # rootless: the user is the human
    name, email, where = gitcell.identity(config_of(state).git_identity, uid, repos, config_of(state).harness)
    safe = list(dict.fromkeys((*rw_paths, *repos)))
    out = {"config": gitcell.system_config(safe, name, email), "name": name, "email": email, "from": where,
           "safe": safe}
    from ...harness import profiles

    real = shutil.which("git", path=DEFAULT_PATH)
    if profiles.get(config_of(state).harness).git_config_isolated and real:
        out["wrapper"] = gitcell.wrapper(os.path.realpath(real), safe)
    return out


def _seed(state: SessionState, uid: int, gid: int, more: tuple[tuple[str, str, bool], ...] = ()
          ) -> tuple[str | None, list[str]]:
    """The seed directory (:mod:`agentcell.harness.seed`): the harness's settings files and the
    home it starts from, the account's, bound read-only into the cell; ``more`` files of the
    session's own (its git configuration). A retried spawn starts it again."""
    from ...harness import seed

    launch = of(Launch, state.get("launch"))
    files = [(f["path"], f["content"], f["home"]) for f in (launch.files if launch else ())] + list(more)
    home_from = config_of(state).home_from
    if not files and not home_from:
        return None, []
    seed.remove(state["session_id"])
    try:
        notes = seed.create(state["session_id"], files, home_from, (uid, gid))
    except (OSError, AgentcellError) as e:
        seed.remove(state["session_id"])
        raise SpawnCrash("seed", line(e) if isinstance(e, AgentcellError) else f"{e.strerror}: "
                         f"{e.filename}") from None
    return seed.path(state["session_id"]), [f"--home-from: not copied: {n}" for n in notes]
