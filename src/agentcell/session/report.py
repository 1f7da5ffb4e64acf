"""What ``agentcell session`` says about a session: the summary of its end (the JSON ``--json`` prints, the
lines on stderr), what ``--explain`` shows before one starts, and the exit status of ``start``."""
from __future__ import annotations

import os
import sys
from typing import Any

from ..errors import EXIT_SETUP, printable

PROG = "agentcell session"
EXIT_TERMINATED = 120  # the session was terminated (an escape attempt, a stop, a lost account or audit log)
EXIT_ABORTED = EXIT_SETUP  # aborted before the agent ran (no backup, no firewall, no cell)


def exit_code(summary: dict[str, Any]) -> int:
    """``start``'s status: the harness's own when it ended by itself (0 at the wall clock)."""
    if summary["status"] == "aborted":
        return EXIT_ABORTED
    if summary["status"] == "terminated":
        return EXIT_TERMINATED
    code = summary.get("exit_status")
    return 0 if summary["reason"] == "timeout" or not isinstance(code, int) else code


def explain(cfg: Any, plan: Any, policy: dict[str, Any], launch: Any, credentials: Any = None) -> str:
    """What a session would be: the harness's launch, what the cell gets, where each value came from."""
    from .. import limits
    from ..policy.compile import explain as explain_policy
    from ..policy.models import SandboxPolicy

    lim = plan.limits
    rows = [("harness", f"{cfg.harness} ({'interactive' if launch.interactive else 'one prompt'})"),
            ("command", " ".join(a if len(a) <= 200 else f"<{len(a)} characters>" for a in launch.argv)),
            ("risk", f"{plan.risk} ({cfg.sources.get('risk', 'default')})"),
            ("ceilings", f"{limits.describe(lim.memory_bytes, lim.cpu_percent, lim.pids)} "
                         f"({cfg.sources.get('limits')})"),
            ("api base", cfg.api_base or "the harness's own"),
            ("allow-list", " ".join([*plan.allow_presets, *plan.allow_domains]) or "-"),
            ("secrets", " ".join(sorted(cfg.secrets)) or "-"),
            ("injected", "; ".join(f"{s.name} -> {','.join(s.hosts)} ({','.join(s.headers) or 'any header'})"
                                   for s in credentials.secrets.values()) if credentials else "-"),
            ("settings", " ".join(("~/" if f.home else "seed/") + f.path for f in launch.files) or "-"),
            ("home from", cfg.home_from or "-"),
            ("caches", "at /cache, the project's own in " + cache_place(cfg) if cfg.cache else "off (--cache off)"),
            ("monitor", monitor_sees())]
    width = max(len(k) for k, _ in rows)
    head = "".join(f"{k:>{width}}: {v}\n" for k, v in rows)
    notes = "".join(f"note: {n}\n" for n in (*cfg.notes, *launch.notes))
    return head + explain_policy(SandboxPolicy.model_validate(policy)) + notes


def monitor_sees() -> str:
    """What the escape monitor of this session can see, as plainly as the user needs it."""
    if os.geteuid() == 0:
        return ("every source: failed calls (eBPF), Landlock denials (the audit stream), execs (the proc "
                "connector), created files (fanotify), seccomp refusals, the decoys, the proxy ('agentcell "
                "doctor' says which this host has)")
    return ("without root, only what the cell reports itself: seccomp refusals, a read of a decoy credential "
            "(inotify), each connection (the proxy); what the mounts and Landlock refuse inside the cell (a "
            "read of a path it does not have, a write outside the project, an exec) is contained but not seen: "
            "eBPF, the audit stream, the proc connector and fanotify need root")


def cache_place(cfg: Any) -> str:
    from .. import caches

    return caches.store() + "/" + caches.key(cfg.project_root, cfg.agent)


def summary(state: Any) -> dict[str, Any]:
    """A session's state as its summary: the JSON ``--json`` and ``--summary-file`` give."""
    from .records import plain

    st: dict[str, Any] = plain(dict(state))
    escape = st.get("escape")
    result = st.get("result") or {}
    return {
        "session": st.get("session_id"),
        "status": st.get("status"),
        "reason": st.get("reason", ""),
        "escape_target": escape.get("target") if escape else None,
        "escape": escape,
        "harness": (st.get("config") or {}).get("harness"),
        "declared_paths": (st.get("policy") or {}).get("rw_paths", []),
        "ceilings": ceilings(st),
        "os_user": (st.get("account") or {}).get("name"),
        "backup_id": st.get("backup_id"),
        "workspace": st.get("workspace_dir"),
        "cell_id": st.get("cell_id"),
        "exit_status": result.get("exit_status"),
        "duration_s": result.get("duration_s"),
        "events": len(st.get("events") or []),
        "problems": st.get("problems") or [],
        "warnings": st.get("warnings") or [],
        "audit_error": st.get("audit_error"),
    }


def ceilings(st: dict[str, Any]) -> str:
    from .. import limits

    cfg = st.get("config") or {}
    if cfg.get("ceilings") is False:
        return "off (--ceilings off)"
    return limits.describe(*(cfg.get("limits") or (None, None, None)))


def print_end(s: dict[str, Any]) -> None:
    line = f"{PROG}: session {s['session']} {s['status']}"
    if s["reason"]:
        line += f" ({s['reason']})"
    sys.stderr.write(shown(line) + "\n")
    if str(s.get("ceilings", "")).startswith("off"):
        sys.stderr.write(f"{PROG}: it ran without ceilings (--ceilings off): no memory, CPU or task limit held it\n")
    if s["backup_id"]:
        sys.stderr.write(f"{PROG}: backup {s['backup_id']}: 'agentcell session diff {s['session']}' shows the "
                         f"changes, 'agentcell session restore {s['session']}' undoes them\n")
    if s["workspace"]:
        sys.stderr.write(f"{PROG}: your project was not written: 'agentcell session review {s['session']}' shows "
                         f"the agent's changes, 'agentcell session apply {s['session']}' lands them, "
                         f"'agentcell session discard {s['session']}' drops them\n")
    for w in s["warnings"]:
        sys.stderr.write(shown(f"{PROG}: warning: {w}") + "\n")
    for p in s["problems"]:
        sys.stderr.write(shown(f"{PROG}: warning: teardown left: {p}") + "\n")
    if s["audit_error"]:
        sys.stderr.write(shown(f"{PROG}: warning: {s['audit_error']}") + "\n")


def shown(text: str) -> str:
    return printable(text)
