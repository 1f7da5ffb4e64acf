"""``agentcell cell start|exec|list|stop``: a live cell for the shell. One cell (namespaces, mounts,
Landlock domain, monitor, proxy) stays up and runs each ``exec`` at the cost of a fork and exec; its
host (:mod:`agentcell.host.server`) listens on a socket only its owner can reach and leaves after
``stop`` or ``--idle`` seconds without a command. Watched by default, as every live cell's face is."""
from __future__ import annotations

import json
import os
import re
import sys
from argparse import REMAINDER, Namespace, RawDescriptionHelpFormatter
from typing import TYPE_CHECKING

from .. import hostfs
from ..errors import EXIT_USAGE, AgentcellError, printable, report
from .common import Parser

if TYPE_CHECKING:
    import _socket

PROG = "agentcell cell"
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")
ACTIONS = ("start", "exec", "list", "stop")


def parser() -> Parser:
    from . import run

    p = Parser(prog=PROG, description="A live cell: start it once, exec many commands in it, stop it. NAME "
               "defaults to 'default'.", epilog="'exec' exits with the command's status (124 on --timeout; 137 "
               "when the cell ended under it, e.g. at an escape attempt, with the reason on stderr).")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=Parser)
    start = sub.add_parser("start", parents=[run.parser(f"{PROG} start")], conflict_handler="resolve",
                           formatter_class=RawDescriptionHelpFormatter, usage="%(prog)s [--name NAME] [--idle S] "
                           "[--no-monitor] [RUN OPTIONS]", help="start a live cell (the options of agentcell run)",
                           description="Start a live cell with agentcell run's options. It is watched: its first "
                           "escape attempt ends it (--on-escape changes the verdict, --no-monitor opts out).")
    start.add_argument("--name", default="default", help="the cell's name (default: default)")
    start.add_argument("--idle", default="3600", metavar="S", help="leave after S seconds without a command "
                       "(default: 3600)")
    start.add_argument("--no-monitor", action="store_true", help="no escape monitor: the kernel still refuses "
                       "what the policy denies, and the cell carries on")
    ex = sub.add_parser("exec", help="run a command in a live cell", usage="%(prog)s [--name NAME] "
                        "[--timeout S] [--env K=V]... [--cwd DIR] -- CMD [ARGS...]")
    ex.add_argument("--name", default="default", help="the cell's name (default: default)")
    ex.add_argument("--timeout", metavar="S", help="kill the command after S seconds (status 124)")
    ex.add_argument("--env", action="append", default=[], metavar="K=V", help="add K=V to the command's environment")
    ex.add_argument("--cwd", metavar="DIR", help="the command's working directory in the cell")
    ex.add_argument("command", nargs=REMAINDER, metavar="-- CMD", help="the command and its arguments")
    ls = sub.add_parser("list", help="list the live cells that run")
    ls.add_argument("--json", action="store_true", help="print JSON")
    stop = sub.add_parser("stop", help="stop a live cell and print its result")
    stop.add_argument("--name", default="default", help="the cell's name (default: default)")
    stop.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def cells_dir(make: bool = False) -> str:
    d = os.path.join(hostfs.socket_dir(), "cells")
    if make:
        hostfs.private_dir(hostfs.socket_dir(), "cell")
        hostfs.private_dir(d, "cell")
    return d


def _name(value: str) -> str:
    if not NAME.fullmatch(value):
        raise AgentcellError("--name", f"'{printable(value)}' is not a cell name",
                             "use lower-case letters, digits, '.', '_' or '-', at most 32, e.g. --name build")
    return value


def _seconds(flag: str, value: str, example: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = -1.0
    if not 0 < s < float("inf"):
        raise AgentcellError(flag, f"{printable(value)} is not a positive number of seconds", f"e.g. {flag} {example}")
    return s


def _connect(name: str) -> _socket.socket:
    from ..host.remote import connect

    s = connect(os.path.join(cells_dir(), f"{name}.sock"))
    if s is None:
        raise AgentcellError("--name", f"no live cell named {name} runs", f"start it: {PROG} start --name {name}")
    return s


def start(ns: Namespace) -> int:
    from ..host.remote import RemoteHost
    from . import run
    from .runargs import live_monitor

    name, idle = _name(ns.name), _seconds("--idle", ns.idle, "600")
    monitor = live_monitor(ns, command_fix=f"run it: {PROG} exec -- CMD",
                           timeout_fix=f"give it to '{PROG} exec', or --idle S")
    spec = run.build_spec(ns)
    path = os.path.join(cells_dir(make=True), f"{name}.sock")
    try:
        _connect(name).close()
    except AgentcellError:
        pass  # none runs: the name is free
    else:
        raise AgentcellError("--name", f"a live cell named {name} runs already", f"stop it: {PROG} stop --name {name}")
    live, host_pid = RemoteHost.open_named(spec, monitor, path, name, idle)
    info = {"name": name, "cell_id": live.cell_id, "pid1": live.pid1, "host_pid": host_pid, "socket": path,
            "monitor": monitor, "network": spec.network}
    if ns.json:
        print(json.dumps(info))
    else:
        watched = "watched" if monitor else "unwatched"
        print(f"live cell {name} started: {live.cell_id} (host pid {host_pid}, {watched}); run commands with "
              f"'{PROG} exec --name {name} -- CMD', stop it with '{PROG} stop --name {name}'")
    live.release()
    return 0


def exec_(ns: Namespace) -> int:
    from ..api import CellEnded, LiveCell
    from ..host.liveclient import RemoteLive

    env: dict[str, str] = {}
    for kv in ns.env:
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise AgentcellError("--env", f"'{printable(kv)}' is not K=V", "e.g. --env LANG=C.UTF-8")
        env[k] = v
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        raise AgentcellError("command", "no command given", f"put it after --, e.g. {PROG} exec -- make test")
    timeout = None if ns.timeout is None else _seconds("--timeout", ns.timeout, "30")
    try:
        live = LiveCell(RemoteLive.connect(_connect(_name(ns.name))))
        proc = live.spawn(command, env=env, cwd=ns.cwd, timeout=timeout)
    except CellEnded as e:
        sys.stderr.write(f"{PROG}: the cell has ended: {printable(e.reason)}\n")
        return 137
    code = proc.wait()
    ended = proc.result.get("ended")
    if proc.result.get("not_started"):  # (it never ran: why, as a shell would say it)
        sys.stderr.write(f"{printable(str(proc.result['not_started']))}\n")
    if ended:
        sys.stderr.write(f"{PROG}: the cell ended under the command: {printable(str(ended))}\n")
    elif proc.result.get("timed_out"):
        sys.stderr.write(f"{PROG}: timed out after {timeout:g} s; the command was killed\n")
    return code


def list_(ns: Namespace) -> int:
    from ..host.remote import ask

    rows = []
    try:
        names = sorted(n[:-5] for n in os.listdir(cells_dir()) if n.endswith(".sock"))
    except OSError:
        names = []
    for name in names:
        try:
            s = _connect(name)
        except AgentcellError:
            continue
        try:
            info = ask(s, "status")
        finally:
            s.close()
        if info is not None:
            rows.append(info)
    if ns.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print(f"no live cells (start one: {PROG} start)")
    for r in rows:
        state = f"ended: {printable(str(r['ended']))}" if r.get("ended") else f"{r['execs']} running"
        print(f"{r['name']:<16} {r['cell_id']}  host pid {r['pid']}  {state}  {r['events']} events  "
              f"up {r['uptime_s']:.0f} s")
    return 0


def stop(ns: Namespace) -> int:
    from ..host.remote import ask
    from ..protect.check import protected_lines

    s = _connect(_name(ns.name))
    try:
        msg = ask(s, "stop")
    finally:
        s.close()
    result = (msg or {}).get("result") or {}
    if ns.json:
        print(json.dumps({"name": ns.name, "reason": (msg or {}).get("reason"), **result}))
        return 0
    print(f"live cell {ns.name} {printable(str((msg or {}).get('reason') or 'stopped'))}")
    for ev in result.get("events") or []:
        print(f"  {'escape' if ev.get('acts') else 'note'}: {printable(str(ev.get('operation')))} "
              f"{printable(str(ev.get('target')))}: {printable(str(ev.get('reason')))}")
    for line in protected_lines(result):
        sys.stderr.write(f"{PROG}: warning: {line}\n")
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] not in (*ACTIONS, "-h", "--help", "help"):
        sys.stderr.write(f"{PROG}: unknown action '{printable(argv[0])}' (one of: {', '.join(ACTIONS)})\n")
        return EXIT_USAGE
    if not argv or argv[0] == "help":
        sys.stdout.write(parser().format_help())
        return 0 if argv else EXIT_USAGE
    ns = parser().parse_args(argv)
    try:
        return {"start": start, "exec": exec_, "list": list_, "stop": stop}[ns.action](ns)
    except AgentcellError as e:
        return report(f"{PROG} {ns.action}", e)
