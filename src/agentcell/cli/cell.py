"""``agentcell cell start|exec|list|stop``: a live cell for the shell. One cell (namespaces, mounts,
Landlock domain, monitor, proxy) stays up and runs each ``exec`` at the cost of a fork and exec; its
host (:mod:`agentcell.host.server`) listens on a socket only its owner can reach and leaves after
``stop`` or ``--idle`` seconds without a command."""
from __future__ import annotations

import json
import os
import re
import socket
import sys
from typing import Any

from .. import hostfs
from ..errors import EXIT_USAGE, AgentcellError, printable, report
from ..host import wire

PROG = "agentcell cell"
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")
USAGE = f"""usage: {PROG} start [--name NAME] [--idle S] [RUN OPTIONS]   start a live cell (options of agentcell run)
       {PROG} exec [--name NAME] [--timeout S] [--env K=V]... [--cwd DIR] -- CMD [ARGS...]
       {PROG} list [--json]
       {PROG} stop [--name NAME] [--json]

NAME defaults to 'default'. 'exec' exits with the command's status (124 on --timeout; 137 when the
cell ended under it, e.g. at an escape attempt, with the reason on stderr).
"""


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


def _take(argv: list[str], flag: str, default: str | None = None) -> tuple[str | None, list[str]]:
    """``flag VALUE`` (or ``flag=VALUE``) out of ``argv`` before its ``--``."""
    end = argv.index("--") if "--" in argv else len(argv)
    for i, a in enumerate(argv[:end]):
        if a == flag:
            if i + 1 >= end:
                raise AgentcellError(flag, "needs a value")
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:], argv[:i] + argv[i + 1:]
    return default, argv


def _connect(name: str) -> socket.socket:
    path = os.path.join(cells_dir(), f"{name}.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.connect(path)
        if not wire.peer_is_ours(s):
            raise OSError("not ours")
    except OSError:
        s.close()
        raise AgentcellError("--name", f"no live cell named {name} runs",
                             f"start it: {PROG} start --name {name}") from None
    return s


def _ask(s: socket.socket, op: str) -> dict[str, Any] | None:
    wire.send(s, {"op": op})
    while True:
        msg, fds = wire.recv_or_gone(s)
        for fd in fds:
            os.close(fd)
        if msg is None or msg.get("event") in ("status", "ended"):
            return msg


def start(argv: list[str]) -> int:
    from ..api import LiveCell
    from ..host import server
    from . import run

    name_arg, argv = _take(argv, "--name", "default")
    idle_arg, argv = _take(argv, "--idle", "3600")
    name = _name(str(name_arg))
    try:
        idle = float(str(idle_arg))
    except ValueError:
        idle = -1.0
    if not 0 < idle < float("inf"):
        raise AgentcellError("--idle", f"{printable(str(idle_arg))} is not a positive number of seconds",
                             "e.g. --idle 600")
    ns = run.parse(argv, f"{PROG} start")
    if ns.command:
        raise AgentcellError("command", "a live cell is started without one", f"run it: {PROG} exec -- CMD")
    if ns.timeout is not None:
        raise AgentcellError("--timeout", "is per command here", f"give it to '{PROG} exec', or --idle S")
    spec = run.build_spec(ns)
    monitor = ns.on_escape or "terminate" if ns.monitor else None
    d = cells_dir(make=True)
    path = os.path.join(d, f"{name}.sock")
    try:
        _connect(name).close()
    except AgentcellError:
        pass  # none runs: the name is free
    else:
        raise AgentcellError("--name", f"a live cell named {name} runs already", f"stop it: {PROG} stop --name {name}")
    from ..host import warm

    proc = warm.serve_detached(path, lambda fd: server.command("--listen", str(fd), "--path", path, "--name", name,
                                                               "--idle", str(idle)), 16)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    s.connect(path)
    try:
        live = LiveCell._handshake(s, None, spec, monitor)
    except AgentcellError:
        os.waitpid(proc.pid, 0)  # it refused the cell and leaves: ours to reap
        raise
    except BaseException:  # ended before the cell was handed over (SIGTERM, ^C): the host takes it down
        import signal

        s.close()
        os.kill(proc.pid, signal.SIGTERM)  # (not proc.terminate(): Popen counts it as gone already)
        os.waitpid(proc.pid, 0)
        raise
    info = {"name": name, "cell_id": live.cell_id, "pid1": live.pid1, "host_pid": proc.pid, "socket": path,
            "monitor": monitor, "network": spec.network}
    if ns.json:
        print(json.dumps(info))
    else:
        print(f"live cell {name} started: {live.cell_id} (host pid {proc.pid}); run commands with "
              f"'{PROG} exec --name {name} -- CMD', stop it with '{PROG} stop --name {name}'")
    s.close()
    return 0


def exec_(argv: list[str]) -> int:
    from ..api import CellEnded, LiveCell

    name_arg, argv = _take(argv, "--name", "default")
    timeout_arg, argv = _take(argv, "--timeout")
    cwd, argv = _take(argv, "--cwd")
    env: dict[str, str] = {}
    while True:
        kv, argv = _take(argv, "--env")
        if kv is None:
            break
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise AgentcellError("--env", f"'{printable(kv)}' is not K=V", "e.g. --env LANG=C.UTF-8")
        env[k] = v
    if argv[:1] == ["--"]:
        argv = argv[1:]
    elif argv and argv[0].startswith("-"):
        raise AgentcellError(argv[0], "is not an option of exec", f"see '{PROG} --help'")
    if not argv:
        raise AgentcellError("command", "no command given", f"put it after --, e.g. {PROG} exec -- make test")
    timeout = None
    if timeout_arg is not None:
        try:
            timeout = float(timeout_arg)
        except ValueError:
            timeout = -1.0
        if not 0 < timeout < float("inf"):
            raise AgentcellError("--timeout", f"{printable(timeout_arg)} is not a positive number of seconds",
                                 "e.g. --timeout 30")
    try:
        live = LiveCell.connect(_connect(_name(str(name_arg))))
        proc = live.spawn(argv, env=env, cwd=cwd, timeout=timeout)
    except CellEnded as e:
        sys.stderr.write(f"{PROG}: the cell has ended: {printable(e.reason)}\n")
        return 137
    code = proc.wait()
    ended = proc.result.get("ended")
    if ended:
        sys.stderr.write(f"{PROG}: the cell ended under the command: {printable(str(ended))}\n")
    elif proc.result.get("timed_out"):
        sys.stderr.write(f"{PROG}: timed out after {timeout:g} s; the command was killed\n")
    return code


def list_(argv: list[str]) -> int:
    d = cells_dir()
    rows = []
    try:
        names = sorted(n[:-5] for n in os.listdir(d) if n.endswith(".sock"))
    except OSError:
        names = []
    for name in names:
        try:
            s = _connect(name)
        except AgentcellError:
            continue
        try:
            info = _ask(s, "status")
        finally:
            s.close()
        if info is not None:
            rows.append(info)
    if "--json" in argv:
        print(json.dumps(rows))
    elif not rows:
        print(f"no live cells (start one: {PROG} start)")
    for r in rows if "--json" not in argv else []:
        state = f"ended: {printable(str(r['ended']))}" if r.get("ended") else f"{r['execs']} running"
        print(f"{r['name']:<16} {r['cell_id']}  host pid {r['pid']}  {state}  {r['events']} events  "
              f"up {r['uptime_s']:.0f} s")
    return 0


def stop(argv: list[str]) -> int:
    name_arg, argv = _take(argv, "--name", "default")
    s = _connect(_name(str(name_arg)))
    try:
        msg = _ask(s, "stop")
    finally:
        s.close()
    result = (msg or {}).get("result") or {}
    if "--json" in argv:
        print(json.dumps({"name": name_arg, "reason": (msg or {}).get("reason"), **result}))
        return 0
    print(f"live cell {name_arg} {printable(str((msg or {}).get('reason') or 'stopped'))}")
    for ev in result.get("events") or []:
        print(f"  {'escape' if ev.get('acts') else 'note'}: {printable(str(ev.get('operation')))} "
              f"{printable(str(ev.get('target')))}: {printable(str(ev.get('reason')))}")
    from .run import protected_lines

    for line in protected_lines(result):
        sys.stderr.write(f"{PROG}: warning: {line}\n")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if argv else EXIT_USAGE
    action, rest = argv[0], argv[1:]
    actions = {"start": start, "exec": exec_, "list": list_, "stop": stop}
    if action not in actions:
        sys.stderr.write(f"{PROG}: unknown action '{printable(action)}' (one of: {', '.join(actions)})\n")
        return EXIT_USAGE
    try:
        return actions[action](rest)
    except AgentcellError as e:
        return report(f"{PROG} {action}", e)
