"""One session plan run on the machine this code is on, as a fleet node runs it (no Ray here).

A node keeps everything under ``BASE/NODE`` (``BASE`` is ``/var/lib/agentcell-fleet`` unless told)::

    state/                  the node's own agentcell state dir: checkpoints, audit trail, backups, accounts
    projects/RUN/NAME/      each plan's project, made from its source (the agent's work stays here)
    runs/RUN/NAME.json      the ledger: written before the session starts, so a node that comes back
                            after a crash knows which of a run's sessions were its own

The session is ``agentcell session start --id RUN-NAME`` in a process of its own, forked by the caller's
session starter (:mod:`.forkserver`: the session's modules imported once, not once a session). It gets
SIGTERM if the caller dies (the starter dies with it) or a task is cancelled, and tears itself down. A
machine that crashes takes the supervisor with it; ``recover`` then finishes those sessions
(``agentcell session recover``) and reports them from the ledger.

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

from .. import hostfs
from ..errors import AgentcellError
from . import forkserver
from .plan import Caps, SessionPlan, git_remote, public

DEFAULT_BASE = "/var/lib/agentcell-fleet"
REFUSED = 125  # session start's exit status for a bad flag or value: nothing was created
TAIL = 8192  # the end of a session's stdout (the harness's output) and stderr, kept in its result
MAX_PATHS = 10_000  # of each kind in a result's diff; more are counted, not listed
MAX_TEXT = 1 << 20  # bytes of text diffs in a result
MAX_TEXT_FILES = 200  # modified files whose text diff is made (each one reads the backup's manifest)
ENDED = ("completed", "terminated", "aborted")  # statuses of a session that ran its teardown


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + os.urandom(3).hex()


def _attempt(attempt: int) -> str:
    return f"_r{attempt}" if attempt > 1 else ""  # '_': no plan name has one, so no name is another's retry


def session_id(run: str, name: str, attempt: int = 1) -> str:
    """RUN-NAME, and _rN for the Nth attempt (a plan lost before its session began runs again): at most
    22 + 1 + 36 + 3 characters, within a session id's 64."""
    return f"{run}-{name}{_attempt(attempt)}"


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
        return os.path.join(self.root, "projects", run, name + _attempt(attempt))

    @property
    def trail(self) -> str:
        from ..audit.trail import path_in

        return path_in(self.state)

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
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise AgentcellError("--owner", f"{owner} is root or in root's group: it cannot own a session's project",
                             "give a person's account")
    return pw


def materialize(plan: SessionPlan, dest: str, pw: Any, caps: Caps | None = None) -> None:
    """Make the plan's project at ``dest`` (which must not exist yet), owned by ``pw``. A copy or a clone
    runs as that account, not as root: a plan gets only what its owner could read. A clone runs on the
    node's network, outside any cell: from public addresses only, unless ``caps`` trust the plan's network."""
    src = plan.project
    os.mkdir(dest, 0o755)
    os.chown(dest, pw.pw_uid, pw.pw_gid)
    if src.files is not None:  # written by the owner too: root never writes into a tree the owner can change
        p = _as(pw, ["tar", "--extract", "--keep-old-files", "--no-same-owner", "--directory", dest, "--file", "-"],
                stdin=_archive(src.files))
        if p.returncode != 0:
            why = next((ln for ln in p.stderr.splitlines() if ln.strip() and "Exiting with failure" not in ln),
                       "(no message)")
            raise AgentcellError("project.files", f"cannot write them as {pw.pw_name}: {why}",
                                 "give relative paths of regular files, none of them twice")
        return
    if src.path is not None:
        p = _as(pw, ["cp", "-R", "--no-dereference", "--preserve=mode,timestamps,links", "--",
                     src.path.rstrip("/") + "/.", dest])
        if p.returncode != 0:
            raise AgentcellError("project.path", f"cannot copy {src.path} as {pw.pw_name}: {_last_line(p.stderr)}",
                                 "give a directory every node has, readable by the owner")
        return
    assert src.git is not None
    pinned = _git_remote(src.git, (caps or Caps()).plan_network)
    p = _as(pw, ["git", *pinned, "clone", "--quiet", "--", src.git, dest])
    if p.returncode == 0 and src.ref:
        p = _as(pw, ["git", "-C", dest, "checkout", "--quiet", "--detach", src.ref, "--"])
    if p.returncode != 0:
        raise AgentcellError("project.git", f"cannot clone {src.git}: {_last_line(p.stderr)}",
                             "give a repository this node can reach (https, ssh, git or a path)")


def _git_remote(url: str, trusted: bool) -> list[str]:
    """git's options for cloning ``url``: the host's addresses checked (public ones only, unless
    ``trusted``: a plan could otherwise have the node fetch an internal service's data into the project,
    for its agent to read out), the address pinned for http(s) so a second lookup cannot differ, and no
    redirect followed (it could lead anywhere). A path or file:// URL is read as the owner: nothing to check."""
    import ipaddress
    import socket

    try:
        remote = git_remote(url)
    except ValueError as e:
        raise AgentcellError("project.git", f"'{url}' {e}", "give an https://, ssh:// or git:// URL, or a path") \
            from None
    if remote is None:
        return []
    scheme, host, port = remote
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise AgentcellError("project.git", f"cannot find {host}: {e}", "give a repository this node can reach") \
            from None
    addrs = [ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in found]
    bad = next((a for a in addrs if not public(a)), None) if not trusted else None
    if bad is not None:
        raise AgentcellError("project.git", f"{host} is {bad}, not a public address: a clone runs on the "
                             "node's network, outside the cell", "clone from a public host, or run with "
                             "--trust-plan-network")
    opts = ["-c", "http.followRedirects=false"]
    if scheme in ("http", "https"):
        a = addrs[0]
        opts += ["-c", f"http.curloptResolve={host}:{port}:{f'[{a}]' if a.version == 6 else a}"]
    return opts


def _archive(files: dict[str, str]) -> bytes:
    """The inline files as a tar archive of regular files (0644, their text as UTF-8), for ``tar`` run as the
    owner to write: a C program's start, not an interpreter's, per session. A plan's paths are relative and
    stay inside the project (:class:`.plan.Project`); a path given twice (``a`` and ``x/../a``) fails, as
    tar keeps the first."""
    import io
    import tarfile

    buf, now = io.BytesIO(), time.time()
    names = {rel: os.path.normpath(rel) for rel in files}
    dirs = {d for name in names.values() for d in _parents(name)}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):  # 0755 (less the umask, as before), not the 0777 tar gives a parent not in it
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, now
            tar.addfile(info)
        for rel, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(names[rel])
            info.size, info.mode, info.mtime = len(data), 0o644, now
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _parents(name: str) -> list[str]:
    """``a/b/c`` -> ``a``, ``a/b``."""
    parts = name.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _as(pw: Any, argv: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """``argv`` as ``pw``'s account (no other groups, no new privileges), with a plain environment."""
    env = {"PATH": os.environ.get("PATH") or "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent",
           "GIT_TERMINAL_PROMPT": "0", "GIT_ALLOW_PROTOCOL": GIT_PROTOCOLS, "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null"}
    p = subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
                        "--no-new-privs", "--", *argv], capture_output=True, env=env, cwd="/",
                       input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL, timeout=600)
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(errors="replace"),
                                       p.stderr.decode(errors="replace"))


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no message)"


def result(plan_name: str, node: str, sid: str, status: str, reason: str, **more: Any) -> dict[str, Any]:
    return {"name": plan_name, "node": node, "session": sid, "status": status, "reason": reason,
            "exit_status": None, "duration_s": None, "summary": None, "audit": None, "diff": None, **more}


def whole(r: dict[str, Any]) -> bool:
    """The session ran its teardown and its audit trail verified."""
    return r["status"] in ENDED and bool((r.get("audit") or {}).get("verified"))


def base_dir(given: str | None) -> str:
    """``--base``: where every node keeps its sessions, projects and ledger (the same path on each)."""
    base = given or DEFAULT_BASE
    if not os.path.isabs(base):
        raise AgentcellError("--base", f"{base} is not an absolute path", "give the directory's full path")
    return base


def owner_of(given: str | None) -> str:
    """``--owner``: the account every node gives the projects to (default: the person behind sudo)."""
    owner = given or os.environ.get("SUDO_USER") or ""
    if not owner or owner == "root":
        raise AgentcellError("--owner", "no account is given to own the projects on the nodes",
                             "give --owner USER (an account every node has), or run through sudo")
    return owner


def run_plan(plan: SessionPlan, run: str, node: Node, owner: str, attempt: int = 1,
             caps: Caps | None = None, env_file: str | None = None) -> dict[str, Any]:
    """Run one plan here, to its end, its project given to ``owner``, its ceilings held to ``caps``; its
    result (see the module's doc). ``env_file``: a ``.env`` on this node for ``session start
    --env-file`` (the harness's keys live there, on each node: they never travel with a plan)."""
    caps = caps or Caps()
    sid = session_id(run, plan.name, attempt)
    ledger = node.ledger(run)
    project = node.project(run, plan.name, attempt)
    for d in (node.state, ledger, os.path.dirname(project)):
        _makedirs(d)
    os.chmod(node.state, 0o700)
    from ..audit import trail

    try:
        since = trail.committed_size(node.trail)  # where this session's part of the node's trail begins
    except (AgentcellError, OSError) as e:  # (a trail that is not a regular file; a writer holding it for long)
        return result(plan.name, node.name, sid, "failed", f"the node's audit trail: {e}")
    entry = {"name": plan.name, "session": sid, "attempt": attempt, "node": node.name, "project": project,
             "started": time.time(), "trail_from": since}
    hostfs.replace_file(os.path.join(ledger, f"{plan.name}.json"), json.dumps(entry).encode())
    try:
        ceilings = caps.ceilings(plan)
        materialize(plan, project, account(owner), caps)
    except (AgentcellError, OSError, subprocess.SubprocessError) as e:
        return result(plan.name, node.name, sid, "failed", f"project: {e}")
    summary_file = os.path.join(ledger, f"{plan.name}{_attempt(attempt)}.summary.json")
    argv = ["session", "start", "--id", sid, "--summary-file", summary_file,
            *([f"--env-file={env_file}"] if env_file else []), *plan.start_args(project, ceilings)]
    # The harness's output shares the session's stdout: kept only as a tail, never parsed.
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    tails = [Tail(out_r), Tail(err_r)]
    try:
        with open(os.devnull, "rb") as null:
            code = forkserver.run(argv, node.environ(), node.root, (null.fileno(), out_w, err_w))
    except (AgentcellError, OSError) as e:
        code, why = None, str(e)
    else:
        why = "the node's session starter ended mid-session" if code is None else ""
    finally:
        os.close(out_w)
        os.close(err_w)
    out, err = (t.text() for t in tails)  # once the session and all it started have closed them
    summary = _read_summary(summary_file)
    if summary is None:
        status = "refused" if code == REFUSED else "failed"
        return result(plan.name, node.name, sid, status, why or _last_line(err), exit_status=code, stderr=err,
                      stdout=out)
    return {**collect(node, plan.name, summary, project, since), "stdout": out, "stderr": err}


class Tail:
    """The last ``TAIL`` bytes of a pipe (its read end's fd, closed at its end), read by a thread of its own
    to the pipe's end."""

    def __init__(self, fd: int) -> None:
        import threading

        self._buf = b""
        self._thread = threading.Thread(target=self._read, args=(fd,), daemon=True)
        self._thread.start()

    def _read(self, fd: int) -> None:
        with open(fd, "rb") as pipe:
            while chunk := pipe.read1(65536):
                self._buf = (self._buf + chunk)[-TAIL:]

    def text(self) -> str:
        self._thread.join()
        return self._buf.decode("utf-8", errors="replace")


def _read_summary(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            out: dict[str, Any] = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return out


_WHOLE: set[str] = set()  # the trails this process has verified whole


def collect(node: Node, plan_name: str, summary: dict[str, Any], project: str, since: int = 0) -> dict[str, Any]:
    """A finished session's result: its summary, audit records and verdict, and its diff (paths relative
    to the project). Read here, in this process: the node's trail and snapshot store are root's files.
    ``since``: where the trail ended as the session began; the chain is checked from there to its end
    (other sessions' records among them, and they may still be running), not the node's whole history,
    which this process checks whole once (its first result here, and each after while it is not whole)."""
    from ..audit import trail
    from ..snapshot.store import Store

    sid = str(summary["session"])
    path = node.trail
    if path not in _WHOLE:
        since = 0
    verdict = trail.verify(path, since)
    if since == 0 and verdict.ok:
        _WHOLE.add(path)
    records = trail.records(path, sid, since)
    ended = bool(records) and records[-1].get("event") == "session.end"
    audit = {"path": path, "since": since, "chain_ok": verdict.ok, "ended": ended, "verified": verdict.ok and ended,
             "problems": [{"line": n, "problem": p} for n, p in verdict.problems], "records": records}
    diff: dict[str, Any] | None = None
    backup = summary.get("backup_id")
    if backup:
        store = Store(os.path.join(node.state, "snapshots"))
        inside = project.rstrip("/") + "/"
        changes = store.diff(str(backup))
        diff = {kind: [p.removeprefix(inside) for p in paths[:MAX_PATHS]] for kind, paths in changes.items()}
        diff["counts"] = {kind: len(paths) for kind, paths in changes.items()}
        text, left = [], MAX_TEXT
        for path in changes["modified"][:MAX_TEXT_FILES]:
            if left <= 0:
                break
            part = store.text_diff(str(backup), path, limit=left)
            text.append(part[:left])
            left -= len(part)
        diff["text"] = "".join(text)
        diff["truncated"] = left <= 0 or len(changes["modified"]) > MAX_TEXT_FILES or \
            any(len(paths) > MAX_PATHS for paths in changes.values())
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
        if fn.endswith(".json") and "." not in fn[:-5]:  # NAME.json (not NAME_rN.summary.json)
            with open(os.path.join(node.ledger(run), fn), encoding="utf-8") as f:
                entry = json.load(f)
            out[str(entry["name"])] = entry
    return out


def _said(stderr: str, sid: str) -> str:
    """What ``session recover`` said of the session ``sid`` (its line naming it), if anything."""
    return next((ln.strip() for ln in stderr.splitlines() if f"session {sid} was not recovered" in ln), "")


def recover(node: Node, run: str, names: list[str] | None = None) -> list[dict[str, Any]]:
    """On a node that came back: finish every session whose supervisor died (``session recover``), then
    the result of each of ``names`` (default: every plan of ``run`` the ledger has here). A plan whose
    session left no record never reached its agent (a session's first step is checkpointed before the
    next begins): its result is ``lost`` with ``never_ran``, and it may run again. One that ``session
    recover`` could not finish stays ``lost``, with ``unrecovered`` and recover's reason for it."""
    r = node.cli("session", "recover", "--json", timeout=None)
    listed = node.cli("session", "list", "--json")
    if listed.returncode != 0:  # without the list every session would look as if it never ran
        raise AgentcellError("recover", f"session list failed on node {node.name}: {_last_line(listed.stderr)}",
                             "see the node's state dir")
    sessions = {str(s["session"]): s for s in json.loads(listed.stdout)}
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
        if summary.get("needs_recover"):  # session recover did not finish it
            why = _said(r.stderr, str(entry["session"]))
            if why:  # it refused this one, saying why: not to be tried again until that is fixed
                out.append(result(name, node.name, str(entry["session"]), "lost",
                                  f"session recover failed on node {node.name}: {why}", unrecovered=True))
            else:  # (its supervisor was alive then, or recover itself failed before it): it may be tried again
                out.append(result(name, node.name, str(entry["session"]), "lost",
                                  f"session recover did not finish it on node {node.name}: "
                                  f"{_last_line(r.stderr) if r.returncode else 'its supervisor was still running'}"))
            continue
        since = entry.get("trail_from")
        since = since if type(since) is int and since >= 0 else 0  # (an older ledger's entry has none: all)
        out.append({**collect(node, name, summary, str(entry["project"]), since), "recovered": True})
    return out
