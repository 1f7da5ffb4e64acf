"""One command in one cell, for ``agentcell run``: its credentials, where the cell is built (a warm
launcher, or here), the explain, and what the result says to a person.

Light to import: the launcher, the supervisor and the monitor are imported only on the path that needs
them (through a warm launcher ``agentcell run`` needs none of them).
"""
from __future__ import annotations

import os

from .cell import terminal
from .cell.spec import TYPE_CHECKING, CellSpec
from .errors import AgentcellError

if TYPE_CHECKING:
    import signal
    from typing import Any

    from .cell.launch import Running
    from .protect.check import SurfaceCheck
else:  # see cell/launch.py
    import _signal as signal

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def credentials(spec: CellSpec, secrets: list[str], secret_hosts: list[str],
                upstream_ca: str | None) -> tuple[Any, str | None]:
    """``--secret``/``--secret-host``/``--upstream-ca``: the credential set (values read now, on the host)
    and the upstream CA's PEM; (None, None) without ``--secret``. Each bound host must be one the proxy
    lets through."""
    if not secrets:
        for flag, given in (("--secret-host", secret_hosts), ("--upstream-ca", upstream_ca)):
            if given:
                raise AgentcellError(flag, "says where a --secret goes", "add --secret NAME")
        return None, None
    if spec.network != "proxy":
        raise AgentcellError("--secret", "credentials are injected by the egress proxy", "add --net proxy")
    from .network.credentials import CredentialSet, off_the_list, parse_bindings, read_values
    from .network.rules import Policy

    creds = CredentialSet.build(read_values(secrets), parse_bindings(secret_hosts))
    rules = Policy.from_rules(spec.egress)
    host = off_the_list((h for s in creds.secrets.values() for h in s.hosts), rules.name_verdict)
    if host is not None:
        raise AgentcellError("--secret-host", f"{host} is not on the allow-list",
                             f"add --allow-domain {host.removeprefix('http://')}")
    pem = None
    if upstream_ca:
        from .network.tlsca import read_bundle

        pem = read_bundle(upstream_ca, "--upstream-ca")
    return creds, pem


def explain(spec: CellSpec, command: list[str]) -> dict[str, object]:
    """What the cell would be, and the launcher's steps for it (:func:`agentcell.cell.launch.describe`)."""
    from .cell import launch, mounts
    from .protect import binds

    ident = spec.identity
    plan = mounts.plan(spec, *binds.for_cell(spec))
    try:
        steps = launch.describe(spec, plan, command)
    finally:
        plan.release()
    return {
        "cell_id": spec.cell_id,
        "identity": {"mode": ident.mode, "uid": ident.uid, "gid": ident.gid, "user": ident.user, "home": ident.home},
        "network": spec.network,
        "rw": list(spec.rw_paths), "ro": list(spec.ro_paths), "masked": list(spec.masked_paths),
        "protected": [s.dest for s in plan.steps if s.kind == "bind" and s.readonly and s.dest not in spec.ro_paths
                      and s.dest not in spec.system_paths],
        "system_ro": [p for p in spec.system_paths if os.path.lexists(p)],
        "scratch": spec.scratch_dir or "tmpfs", "home": spec.home_dir or "tmpfs",
        "env": sorted(k for k, _ in spec.env),
        "cwd": spec.cwd,
        "command": command,
        "steps": steps,
    }


def explain_text(info: dict[str, object]) -> str:
    keys = ("cell_id", "identity", "network", "rw", "ro", "masked", "protected", "system_ro", "scratch", "home",
            "env", "cwd", "command")
    steps = info["steps"]
    assert isinstance(steps, list)
    return "".join([*(f"{key:>10}: {info[key]}\n" for key in keys), "     steps:\n",
                    *(f"            {s}\n" for s in steps)])


def run(spec: CellSpec, command: list[str], timeout: float | None, *, monitor: str | None, warm: bool,
        credentials: Any = None, upstream_ca: str | None = None) -> dict[str, Any]:
    """Run ``command`` in a cell for ``spec``: through the warm launcher when one runs and may (``warm``),
    else built here. A terminal stays here (job control needs the cell in its session); so do credentials
    (the warm launcher is another process: the values go no further than this one and its proxy)."""
    ttys, interactive = terminal.tty_fds(), terminal.is_ours()
    from .protect.check import SurfaceCheck, human

    guard = SurfaceCheck(spec, human())  # the protected-path step, on either path
    result = None
    if not ttys and warm and credentials is None:
        from .host import warm as launcher

        result = launcher.run(spec, command, timeout, monitor)
        if result is not None:
            result["via"] = "warm launcher"
            guard.check(result, str(result.get("cell_id") or spec.cell_id))
    if result is None:
        result = _run_here(spec, command, timeout, ttys, interactive, guard, monitor=monitor,
                           credentials=credentials, upstream_ca=upstream_ca)
    for sig in FORWARDED:  # the cell has ended: a signal now ends us, as it would any command
        signal.signal(sig, signal.SIG_DFL)
    return result


def _run_here(spec: CellSpec, command: list[str], timeout: float | None, ttys: tuple[int, ...],
              interactive: bool, guard: SurfaceCheck, monitor: str | None = None, credentials: Any = None,
              upstream_ca: str | None = None) -> dict[str, Any]:
    """The cold path: build the cell in this process. Where our 0, 1, 2 are terminals the cell gets a
    pty of its own, relayed; stdin only when the run is interactive (else /dev/null)."""
    from .supervise import Supervised

    stdio = [0, 1, 2]
    if 0 in ttys and not interactive:
        stdio[0] = os.open(os.devnull, os.O_RDONLY)
        ttys = tuple(fd for fd in ttys if fd != 0)
    sup = Supervised.start(spec, command, monitor=monitor, stdio=stdio, tty_fds=ttys, guard=guard,
                           credentials=credentials, upstream_ca=upstream_ca)
    try:
        cell = _wait_here(sup.running, timeout, interactive)
    except BaseException:
        sup.finish(None)
        raise
    return sup.finish(cell)


def _wait_here(running: Running, timeout: float | None, interactive: bool) -> dict[str, Any]:
    relay = terminal.Relay(running.pty_master, interactive) if running.pty_master is not None else None

    def forward(sig: int, _frame: object) -> None:
        running.forward(sig)

    for s in FORWARDED:
        signal.signal(s, forward)
    timed_out = False
    if relay is not None:
        timed_out = relay.pump(running, None if timeout is None else running.started + timeout)
    result = running.wait(None if timed_out else timeout, clean_up=False)
    if timed_out:
        result.timed_out, result.exit_status, result.signal = True, 124, signal.SIGKILL
    return dict(result.as_dict(), via="here")


def ended(result: dict[str, Any], timeout: float | None) -> list[str]:
    """What a person is told of a run's end (one line each), and its exit status settled in ``result``."""
    from .protect.check import protected_lines

    out = [*monitor_lines(result), *(f"warning: {line}" for line in protected_lines(result))]
    if result.get("egress_blocked"):
        from .network import egress

        out.append(egress.summary(result["egress_blocked"]))
    if result["error"]:
        out.append(str(result["error"]))
    elif result["timed_out"]:
        out.append(f"timed out after {timeout:g} s; the cell was killed")
    if result.get("terminated_by_monitor") and result["exit_status"] != 128 + signal.SIGKILL:
        # Killed at an escape attempt, even where the command ended first (a rootless monitor learns of a
        # decoy's open after it): the status says so, whatever the command's own was.
        result["command_exit_status"], result["exit_status"], result["signal"] = result["exit_status"], 137, 9
    return out


def monitor_lines(result: dict[str, Any]) -> list[str]:
    """What the monitor saw, from a result (the cold path's, or a warm launcher's cell host's)."""
    if "monitor_sources" not in result:
        return []
    from .monitor.lines import chain, event_kind, event_line

    out = []
    off = {k: v for k, v in result["monitor_sources"].items() if not str(v).startswith("on")}
    if off:
        out.append(f"monitor: not watched: {'; '.join(f'{k} ({v})' for k, v in sorted(off.items()))}")
    for ev in result.get("events") or []:
        out.append(f"{event_kind(ev)}: {event_line(ev)}")
        if event_kind(ev) == "escape" and chain(ev):  # who tried, from the cell's PID 1 down
            out.append(f"  by: {chain(ev)}")
    if result.get("terminated_by_monitor"):  # named here too: a flood of events may have pushed it out of the list
        reason = str(result.get("monitor_reason") or "")
        shown = reason if reason.isprintable() else repr(reason)
        out.append(f"the cell was {'frozen and ' if result.get('monitor_frozen') else ''}killed at the first escape "
                   f"attempt: {shown} (--on-escape record to only record)")
    return out
