"""``agentcell warm start|stop|status``: the per-user warm launcher behind a fast ``agentcell run``."""
from __future__ import annotations

import json

from ..errors import AgentcellError, report
from ..host import warm
from .common import Parser

PROG = "agentcell warm"


def parser() -> Parser:
    p = Parser(prog=PROG, description="A per-user launcher that keeps the next cell prepared, so "
               "`agentcell run` hands its command over instead of building a cell from scratch. "
               "It serves only its own uid and exits after --idle seconds without work.")
    sub = p.add_subparsers(dest="action", required=True, metavar="start|stop|status")
    st = sub.add_parser("start", help="start the launcher (if none runs)")
    st.add_argument("--idle", type=float, default=900.0, metavar="S", help="exit after S idle seconds (900)")
    sub.add_parser("stop", help="stop the launcher; cells it runs are killed")
    ss = sub.add_parser("status", help="is a launcher running for this user?")
    ss.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    try:
        if ns.action == "start":
            if not ns.idle > 0:
                raise AgentcellError("--idle", f"{ns.idle} is not a positive number of seconds", "e.g. --idle 600")
            pid, now = warm.start(ns.idle)
            print(f"warm launcher {'started' if now else 'already running'}: pid {pid}, socket {warm.socket_dir()}")
            return 0
        if ns.action == "stop":
            stopped = warm.stop()
            print("no warm launcher is running" if stopped is None else f"stopped warm launcher pid {stopped}")
            return 0
        info = warm.status()
        if ns.json:
            print(json.dumps(info))
        elif info is None:
            print("no warm launcher is running (agentcell warm start)")
        else:
            print(f"warm launcher pid {info['pid']}: {info['cells']} cells running, next cell "
                  f"{'prepared' if info['warm'] else 'not prepared'}, up {info['uptime_s']:.0f} s")
        return 0 if info is not None else 1
    except AgentcellError as e:
        return report(PROG, e)
