"""``agentcell session`` on the sessions kept: list, show, stop, restore, diff, recover, and the
review, apply and discard of a copy-on-write workspace's change set."""
from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from ..errors import AgentcellError, printable
from .records import plain
from .report import PROG, print_end, shown, summary
from .request import checked_id


def run(cmd: str, ns: Any) -> int:
    """The command ``cmd`` with the parser's options ``ns``: its exit status."""
    commands: dict[str, Callable[[Any], int]] = {
        "list": _list, "show": _show, "stop": _stop, "restore": _restore, "diff": _diff, "review": _review,
        "apply": _apply, "discard": _discard, "recover": _recover}
    return commands[cmd](ns)


def _load(sid: str) -> tuple[Any, dict[str, Any]]:
    checked_id(sid)
    from . import graph

    g, _conn = graph.open_graph()
    st = graph.load(g, sid)
    if st is None:
        raise AgentcellError("ID", f"no session {sid}", "see 'agentcell session list'")
    from .state import check_recorded

    check_recorded(st, sid)
    return g, plain(dict(st))


def _list(ns: Any) -> int:
    from . import graph

    if ns.unapplied:
        from .. import workspace

        waiting = workspace.listing(unapplied_only=True)
        if ns.json:
            sys.stdout.write(json.dumps(waiting) + "\n")
        for w in [] if ns.json else waiting:
            sys.stdout.write(shown(f"{w['session']}  {w['project']}  (review, apply or discard it)") + "\n")
        return 0

    g, conn = graph.open_graph()
    rows = []
    for sid in graph.session_ids(conn):
        try:
            st = graph.load(g, sid)
            if st is None:
                continue
            row = {**summary(dict(st)), "needs_recover": graph.unfinished(st)}
            json.dumps(row)  # (one row that cannot be written is that row's problem, not the listing's)
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - a checkpoint agentcell did not write so: listed as such, not fatal
            rows.append({"session": sid, "harness": None, "status": None, "needs_recover": True,
                         "reason": f"its checkpoint cannot be read ({type(e).__name__}: {e})"})
    if ns.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    for r in rows:
        status = str(r["status"] or "?") + (" (supervisor gone: session recover)" if r["needs_recover"] else "")
        sys.stdout.write(shown(f"{r['session']}  {str(r['harness'] or '?'):<11} {status:<10} {r['reason']}") + "\n")
    return 0


def _show(ns: Any) -> int:
    _g, st = _load(ns.id)
    st["argv"] = [a if len(a) <= 200 else f"<{len(a)} characters>" for a in st.get("argv", [])]
    if ns.json:
        sys.stdout.write(json.dumps(st, default=str) + "\n")
    else:
        from ..monitor.lines import chain, event_kind, event_line

        for k, v in st.items():
            sys.stdout.write(shown(f"{k}: {json.dumps(v, default=str)}") + "\n")
        for ev in st.get("events") or []:  # what the monitor saw, each with who did it
            sys.stdout.write(f"{event_kind(ev)}: {event_line(ev)}\n")
            if chain(ev):
                sys.stdout.write(f"  by: {chain(ev)}\n")
    return 0


def _stop(ns: Any) -> int:
    from . import state

    _g, st = _load(ns.id)
    if st.get("finished"):
        raise AgentcellError("ID", f"session {ns.id} has ended ({st.get('status')})", "nothing to stop")
    if not state.supervisor_alive(st):  # type: ignore[arg-type]
        raise AgentcellError("ID", f"session {ns.id} has no supervisor any more",
                             "'agentcell session recover' finishes its teardown")
    os.kill(int(st["supervisor"]["pid"]), signal.SIGTERM)  # it terminates the cell and tears down
    sys.stderr.write(f"{PROG}: asked the supervisor of {ns.id} (pid {st['supervisor']['pid']}) to stop it\n")
    return 0


def _ended(st: dict[str, Any], sid: str) -> None:
    from . import state

    if not st.get("finished") and state.supervisor_alive(st):  # type: ignore[arg-type]
        raise AgentcellError("ID", f"session {sid} is still running", f"stop it first: agentcell session stop {sid}")
    if not st.get("backup_id"):
        raise AgentcellError("ID", f"session {sid} has no backup (it {st.get('status')} before its preflight)",
                             "nothing was changed by an agent")


def _store(st: dict[str, Any]) -> Any:
    from ..snapshot.store import Store

    return Store((st.get("config") or {}).get("backup_dir"))


def _restore(ns: Any) -> int:
    from ..audit.trail import AuditLog

    _g, st = _load(ns.id)
    _ended(st, ns.id)
    n = _store(st).restore(st["backup_id"])
    log = AuditLog((st.get("config") or {}).get("audit_log_path"))
    log.append("session.restore", session=ns.id, backup_id=st["backup_id"], entries=n)
    if problem := log.seal():
        sys.stderr.write(f"{PROG}: warning: {problem}; the heads wait on this host ('agentcell audit seal' retries)\n")
    sys.stderr.write(f"{PROG}: restored {n} entries of {', '.join(st['policy']['rw_paths'])} from backup "
                     f"{st['backup_id']}\n")
    return 0


def _diff(ns: Any) -> int:
    _g, st = _load(ns.id)
    _ended(st, ns.id)
    store = _store(st)
    changes = store.diff(st["backup_id"])
    if ns.json:
        sys.stdout.write(json.dumps(changes) + "\n")
        return 0
    for kind, mark in (("added", "A"), ("modified", "M"), ("deleted", "D")):
        for path in changes[kind]:
            sys.stdout.write(shown(f"{mark} {path}") + "\n")
    for path in changes["modified"]:
        text = store.text_diff(st["backup_id"], path)
        if text:
            sys.stdout.write(printable(text, keep="\n\t"))
    return 0


def _review(ns: Any) -> int:
    from .. import workspace

    _workspace_ended(checked_id(ns.id))
    r = workspace.review(ns.id, diffs=ns.diff)
    workspace.record_review(r)
    if ns.json:
        sys.stdout.write(json.dumps(r) + "\n")
        return 0
    marks = {"added": "A", "modified": "M", "deleted": "D", "renamed": "R", "mode": "m", "type": "T"}
    base = r["base"]["commit"] or "the project's files"
    sys.stdout.write(shown(f"session {r['session']} ({r['state']}) on {r['project']}, from {base}") + "\n")
    for c in r["changes"]:
        what = f"{c['from']} -> {c['path']}" if c["change"] == "renamed" else c["path"]
        if c.get("link") is not None:
            what += f" (a link to {c['link']})"
        if c["change"] in ("mode", "added", "type") and c.get("mode") is not None and c.get("link") is None:
            what += f" (mode {c['mode']:o})"
        notes = [n for n, on in (
            ("not a file, a link or a directory: never applied", c.get("special")),
            ("committed: in the branch", c.get("committed")),
            ("ignored by git: left out unless --theirs names it", c.get("ignored")),
            ("CONFLICT: you changed it too since the session began", c["conflict"]),
            (f"decides what runs ({c['control']}): applied only with --theirs", c.get("control")),
            (f"replaces {len(c.get('removes') or [])} file(s) of yours", c.get("removes") and not c.get("dir")))
            if on]
        if c.get("dir"):
            what += "/ (a directory)"
        sys.stdout.write(shown(f"{marks[c['change']]} {what}" + "".join(f" ({n})" for n in notes)) + "\n")
        for f in (c.get("removes") or []) if c.get("dir") else []:
            sys.stdout.write(shown(f"  D {f}") + "\n")
    if not r["changes"]:
        sys.stdout.write("no change to the files\n")
    for cm in r["commits"]:
        sys.stdout.write(shown(f"commit {cm['commit'][:12]} {cm['subject']} ({cm['author']}), "
                                f"{len(cm['files'])} file(s)") + "\n")
        for f in cm["control"]:
            sys.stdout.write(shown(f"  changes {f}, which decides what git, your shell or your agent runs") + "\n")
    if r["branch"]:
        sys.stdout.write(shown(f"apply brings the commits as the branch {r['branch']}") + "\n")
    if r.get("git_problem"):
        sys.stdout.write(shown(f"the agent's commits are not taken: {r['git_problem']}") + "\n")
    if ns.diff:
        for c in r["changes"]:
            if c.get("diff"):
                sys.stdout.write(printable(c["diff"], keep="\n\t"))
    return 0


def _workspace_ended(sid: str) -> None:
    """Review, apply and discard wait for the session's end (its agent may still be writing the change
    set, which is walked as root)."""
    from . import graph, state

    try:
        g, _conn = graph.open_graph()
        st = graph.load(g, sid)
    except AgentcellError:
        return
    if st is not None and not st.get("finished") and state.supervisor_alive(st):
        raise AgentcellError("ID", f"session {sid} is still running", f"stop it first: agentcell session stop {sid}")


def _apply(ns: Any) -> int:
    from .. import workspace

    _workspace_ended(checked_id(ns.id))
    try:
        r = workspace.apply(ns.id, ours=ns.ours, theirs=ns.theirs)
    except OSError as e:  # rolled back already (workspace._land)
        raise AgentcellError("apply", f"{e.filename or ''}: {e.strerror}; nothing was written (what had been was "
                             "put back)", "fix the cause and apply again") from None
    if ns.json:
        sys.stdout.write(json.dumps(r) + "\n")
        return 0
    sys.stdout.write(shown(f"applied {len(r['landed'])} path(s) of session {ns.id}") + "\n")
    for p in r["landed"]:
        sys.stdout.write(shown(f"  {p}") + "\n")
    if r["branch"]:
        sys.stdout.write(shown(f"its commits: branch {r['branch']} (git merge or cherry-pick it)") + "\n")
    for w in r.get("warnings") or []:
        sys.stderr.write(shown(f"{PROG}: warning: {w}") + "\n")
    return 0


def _discard(ns: Any) -> int:
    from .. import workspace

    _workspace_ended(checked_id(ns.id))
    try:
        workspace.discard(ns.id)
    except OSError as e:
        raise AgentcellError("discard", f"{e.filename or ''}: {e.strerror}",
                             "fix the cause and discard again") from None
    sys.stdout.write(shown(f"discarded session {ns.id}'s workspace") + "\n")
    return 0


def _recover(ns: Any) -> int:
    from . import graph
    from .state import FAULTS_ENV, Runtime, parse_faults

    # (the test hook reaches recover too: kill@terminate, kill@cleanup, kill@audit kill it, as they do a supervisor)
    g, conn = graph.open_graph(Runtime(faults=parse_faults(os.environ.get(FAULTS_ENV, ""))))
    done, failed = [], []
    try:
        for sid in graph.session_ids(conn):
            try:
                st = graph.load(g, sid)
                if st is None or not graph.unfinished(st):
                    continue
                final = graph.recover(g, sid)
                done.append(summary(dict(final)))
            except AgentcellError as e:  # this one stays unfinished, said why; the others are still finished
                failed.append(sid)
                sys.stderr.write(shown(f"{PROG}: session {sid} was not recovered: {e}") + "\n")
            except Exception:  # noqa: BLE001 - a bug of ours: its traceback, and the other sessions still finished
                import traceback

                failed.append(sid)
                sys.stderr.write(shown(f"{PROG}: session {sid} was not recovered (a bug in agentcell):") + "\n" +
                                 printable(traceback.format_exc(), keep="\n"))
            else:
                print_end(done[-1])
    finally:
        conn.close()
    if ns.json:
        sys.stdout.write(json.dumps(done) + "\n")
    elif not done and not failed:
        sys.stderr.write(f"{PROG}: nothing to recover\n")
    if failed:
        raise AgentcellError("recover", f"{len(failed)} session(s) not recovered: {', '.join(failed)}",
                             "see each one's reason above; fix it, then run 'agentcell session recover' again")
    return 0
