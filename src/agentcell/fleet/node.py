"""One session plan run on the machine this code is on, as a fleet node runs it (no Ray here).

A node keeps everything under ``BASE/NODE`` (``BASE`` is ``/var/lib/agentcell-fleet`` unless told)::

    state/                  the node's own agentcell state dir: checkpoints, audit trail, backups, accounts
    projects/RUN/NAME/      each plan's project, made from its source (the agent's work stays here)
    runs/RUN/NAME.json      the ledger: written before the session starts, so a node that comes back
                            after a crash knows which of a run's sessions were its own

The session is ``agentcell session start --id RUN-NAME`` in a child process of the caller (a Ray worker),
which gets SIGTERM if the caller dies (``setpriv --pdeathsig``): a cancelled task stops its session, and
the session tears itself down. A machine that crashes takes the supervisor with it; ``recover`` then
finishes those sessions (``agentcell session recover``) and reports them from the ledger.

What comes back is plain data: the session's JSON summary, its audit records with the verdict on the
node's trail, and its ``session diff`` (the changes, and the text of each changed file's diff).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from ..errors import AgentcellError
from .plan import SessionPlan

DEFAULT_BASE = "/var/lib/agentcell-fleet"
REFUSED = 125  # session start's exit status for a bad flag or value: nothing was created
TAIL = 2000  # the end of a failed command's stderr, kept in its result


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + os.urandom(3).hex()


def session_id(run: str, name: str, attempt: int = 1) -> str:
    """RUN-NAME, and -rN for the Nth attempt (a plan lost before its session began runs again): at most
    22 + 1 + 36 + 3 characters, within a session id's 64."""
    return f"{run}-{name}" + (f"-r{attempt}" if attempt > 1 else "")


@dataclass(frozen=True)
class Node:
    """A node's directories. ``name`` is the node's agentcell name (a Ray label, or the host's name)."""

    base: str
    name: str

    @property
    def root(self) -> str:
        return os.path.join(self.base, self.name)

    @property
    def state(self) -> str:
        return os.path.join(self.root, "state")

    def project(self, run: str, name: str, attempt: int = 1) -> str:
        return os.path.join(self.root, "projects", run, name + (f"-r{attempt}" if attempt > 1 else ""))

    def ledger(self, run: str) -> str:
        return os.path.join(self.root, "runs", run)

    def environ(self) -> dict[str, str]:
        """The session's whole environment: the node's state dir and nothing of the caller's (a Ray
        worker's variables, or a driver's, would otherwise become session configuration)."""
        return {"PATH": os.environ.get("PATH") or "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                "HOME": "/root", "AGENTCELL_STATE_DIR": self.state}

    def cli(self, *args: str, timeout: float | None = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(agentcell_command(*args), capture_output=True, text=True, env=self.environ(),
                              cwd=self.root, stdin=subprocess.DEVNULL, timeout=timeout)


def agentcell_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentcell.cli.main", *args]


def _makedirs(path: str) -> None:
    os.makedirs(path, mode=0o711, exist_ok=True)  # root's; an agent account may pass through to its project


def _write_json(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


GIT_PROTOCOLS = "https:http:ssh:git:file"  # never ext:: (a command run by the URL) or another transport


def account(owner: str) -> Any:
    """The account that owns the projects here: a session refuses a root-owned project, since what the
    agent makes there would become root's."""
    import pwd

    try:
        pw = pwd.getpwnam(owner)
    except KeyError:
        raise AgentcellError("--owner", f"there is no account {owner} on this node",
                             "give an account every node has") from None
    if pw.pw_uid == 0:
        raise AgentcellError("--owner", "root cannot own a session's project", "give a person's account")
    return pw


def materialize(plan: SessionPlan, dest: str, pw: Any) -> None:
    """Make the plan's project at ``dest`` (which must not exist yet), owned by ``pw``. A copy or a clone
    runs as that account, not as root: a plan gets only what its owner could read."""
    src = plan.project
    os.mkdir(dest, 0o755)
    os.chown(dest, pw.pw_uid, pw.pw_gid)
    if src.files is not None:
        for rel, text in sorted(src.files.items()):
            path = os.path.join(dest, os.path.normpath(rel))
            parent = os.path.dirname(path)
            if not os.path.isdir(parent):
                os.makedirs(parent, mode=0o755)
                for d in _between(dest, parent):
                    os.chown(d, pw.pw_uid, pw.pw_gid)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                os.fchown(f.fileno(), pw.pw_uid, pw.pw_gid)
        return
    if src.path is not None:
        p = _as(pw, ["cp", "-R", "--no-dereference", "--preserve=mode,timestamps,links", "--",
                     src.path.rstrip("/") + "/.", dest])
        if p.returncode != 0:
            raise AgentcellError("project.path", f"cannot copy {src.path} as {pw.pw_name}: {_last_line(p.stderr)}",
                                 "give a directory every node has, readable by the owner")
        return
    assert src.git is not None
    p = _as(pw, ["git", "clone", "--quiet", "--", src.git, dest])
    if p.returncode == 0 and src.ref:
        p = _as(pw, ["git", "-C", dest, "checkout", "--quiet", "--detach", src.ref, "--"])
    if p.returncode != 0:
        raise AgentcellError("project.git", f"cannot clone {src.git}: {_last_line(p.stderr)}",
                             "give a repository this node can reach (https, ssh, git or a path)")


def _between(top: str, leaf: str) -> list[str]:
    """The directories from below ``top`` down to ``leaf``."""
    out = []
    while leaf != top:
        out.append(leaf)
        leaf = os.path.dirname(leaf)
    return out


def _as(pw: Any, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH") or "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent",
           "GIT_TERMINAL_PROMPT": "0", "GIT_ALLOW_PROTOCOL": GIT_PROTOCOLS, "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null"}
    return subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
                           "--no-new-privs", "--", *argv], capture_output=True, text=True, env=env, cwd="/",
                          stdin=subprocess.DEVNULL, timeout=600)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no message)"


def result(plan_name: str, node: str, sid: str, status: str, reason: str, **more: Any) -> dict[str, Any]:
    return {"name": plan_name, "node": node, "session": sid, "status": status, "reason": reason,
            "exit_status": None, "duration_s": None, "summary": None, "audit": None, "diff": None, **more}


def run_plan(plan: SessionPlan, run: str, node: Node, owner: str, attempt: int = 1) -> dict[str, Any]:
    """Run one plan here, to its end, its project given to ``owner``; its result (see the module's doc)."""
    sid = session_id(run, plan.name, attempt)
    ledger = node.ledger(run)
    project = node.project(run, plan.name, attempt)
    for d in (node.state, ledger, os.path.dirname(project)):
        _makedirs(d)
    os.chmod(node.state, 0o700)
    _write_json(os.path.join(ledger, f"{plan.name}.json"),
                {"name": plan.name, "session": sid, "node": node.name, "project": project, "started": time.time()})
    try:
        materialize(plan, project, account(owner))
    except (AgentcellError, OSError, subprocess.SubprocessError) as e:
        return result(plan.name, node.name, sid, "failed", f"project: {e}")
    cmd = ["setpriv", "--pdeathsig", "TERM", "--", *agentcell_command(
        "session", "start", "--id", sid, "--json", *plan.start_args(project))]
    p = subprocess.run(cmd, capture_output=True, text=True, env=node.environ(), cwd=node.root,
                       stdin=subprocess.DEVNULL)
    summary = _summary(p.stdout)
    if summary is None:
        status = "refused" if p.returncode == REFUSED else "failed"
        return result(plan.name, node.name, sid, status, _last_line(p.stderr), stderr=p.stderr[-TAIL:],
                      exit_status=p.returncode)
    return collect(node, plan.name, summary, project)


def _summary(stdout: str) -> dict[str, Any] | None:
    lines = stdout.rstrip("\n").split("\n")
    if not lines or not lines[-1].startswith("{"):
        return None
    try:
        out: dict[str, Any] = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return out


def collect(node: Node, plan_name: str, summary: dict[str, Any], project: str) -> dict[str, Any]:
    """A finished session's result: its summary, audit records and verdict, and its diff (paths relative
    to the project). Read here, in this process: the node's trail and snapshot store are root's files."""
    from ..audit import trail
    from ..snapshot.store import Store

    sid = str(summary["session"])
    path = os.path.join(node.state, "audit", "audit.jsonl")
    verdict = trail.verify(path)  # the whole trail as it stands; other sessions may still be running
    records = trail.records(path, sid)
    ended = bool(records) and records[-1].get("event") == "session.end"
    audit = {"path": path, "chain_ok": verdict.ok, "ended": ended, "verified": verdict.ok and ended,
             "problems": [{"line": n, "problem": p} for n, p in verdict.problems], "records": records}
    diff: dict[str, Any] | None = None
    backup = summary.get("backup_id")
    if backup:
        store = Store(os.path.join(node.state, "snapshots"))
        inside = project.rstrip("/") + "/"
        changes = store.diff(str(backup))
        diff = {kind: [p.removeprefix(inside) for p in paths] for kind, paths in changes.items()}
        diff["text"] = "".join(store.text_diff(str(backup), p) for p in changes["modified"])
    return result(plan_name, node.name, sid, str(summary.get("status")), str(summary.get("reason") or ""),
                  exit_status=summary.get("exit_status"), duration_s=summary.get("duration_s"), summary=summary,
                  audit=audit, diff=diff)


def ledger_entries(node: Node, run: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(node.ledger(run)))
    except FileNotFoundError:
        return out
    for fn in names:
        if fn.endswith(".json"):
            with open(os.path.join(node.ledger(run), fn), encoding="utf-8") as f:
                entry = json.load(f)
            out[str(entry["name"])] = entry
    return out


def recover(node: Node, run: str, names: list[str] | None = None) -> list[dict[str, Any]]:
    """On a node that came back: finish every session whose supervisor died (``session recover``), then
    the result of each of ``names`` (default: every plan of ``run`` the ledger has here). A plan whose
    session left no record never reached its agent (a session's first step is checkpointed before the
    next begins): its result is ``lost`` with ``never_ran``, and it may run again."""
    r = node.cli("session", "recover", "--json", timeout=None)
    if r.returncode != 0:
        raise AgentcellError("recover", f"session recover failed on node {node.name}: {_last_line(r.stderr)}",
                             "see the node's state dir")
    listed = node.cli("session", "list", "--json")
    sessions = {str(s["session"]): s for s in (json.loads(listed.stdout) if listed.returncode == 0 else [])}
    entries = ledger_entries(node, run)
    out = []
    for name in sorted(entries if names is None else names):
        entry = entries.get(name)
        if entry is None:
            out.append(result(name, node.name, "", "lost", f"node {node.name} has no record of it: it never started",
                              never_ran=True))
            continue
        summary = sessions.get(str(entry["session"]))
        if summary is None:
            out.append(result(name, node.name, str(entry["session"]), "lost",
                              "its session left no record: it died before its first step", never_ran=True))
            continue
        out.append({**collect(node, name, summary, str(entry["project"])), "recovered": True})
    return out
