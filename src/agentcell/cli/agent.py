"""``agentcell agent``: persistent agent accounts (a UNIX user per agent), their shares, and running them;
``agentcell agent --help`` lists the subcommands, :mod:`agentcell.accounts` what each does to the system."""
from __future__ import annotations

import os
import sys

from ..errors import AgentcellError, report
from .agent_run import DEFAULT, PROG, RunArgs, fast_parse, run_as_agent

TYPE_CHECKING = False  # see cell/spec.py
if TYPE_CHECKING:
    from argparse import Namespace

    from .common import Parser


def parser() -> Parser:
    from argparse import REMAINDER

    from .common import Parser

    p = Parser(prog=PROG, description="Agent accounts: a UNIX user per agent, sharing folders through ACLs, "
               "run only inside a cell.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser, required=True)

    def changes(sp: Parser) -> None:
        sp.add_argument("--verbose", "-v", action="store_true", help="print every privileged command as it runs")
        sp.add_argument("--dry-run", action="store_true", help="print the privileged commands; change nothing")

    sp = sub.add_parser("new", help="create an agent account")
    sp.add_argument("name", nargs="?", default=DEFAULT, metavar="NAME")
    sp.add_argument("--human", metavar="USER", help="the account that shares files with it (default: SUDO_USER)")
    sp.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    changes(sp)

    sp = sub.add_parser("list", help="list agent and session accounts")
    sp.add_argument("--json", action="store_true")

    sp = sub.add_parser("info", help="show an agent and check its health (exit 1 if unhealthy)")
    sp.add_argument("name", nargs="?", default=DEFAULT, metavar="NAME")
    sp.add_argument("--json", action="store_true")

    sp = sub.add_parser("delete", help="delete an agent account")
    sp.add_argument("name", nargs="?", default=DEFAULT, metavar="NAME")
    sp.add_argument("--delete-home", action="store_true", help="also remove its home directory")
    sp.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    changes(sp)

    mp = sub.add_parser("mount", help="share folders with an agent")
    msub = mp.add_subparsers(dest="mount_cmd", metavar="add|remove|list", parser_class=Parser, required=True)
    sp = msub.add_parser("add", help="share a folder (read-only unless --rw)")
    mode = sp.add_mutually_exclusive_group()
    mode.add_argument("--ro", dest="mode", action="store_const", const="ro", help="read-only (the default)")
    mode.add_argument("--rw", dest="mode", action="store_const", const="rw", help="read-write")
    sp.add_argument("source", metavar="SOURCE")
    sp.add_argument("target", nargs="?", metavar="TARGET", help="where the agent sees it: its own path (the only "
                    "place supported)")
    sp.add_argument("--agent", "-a", default=DEFAULT, metavar="NAME")
    changes(sp)
    sp = msub.add_parser("remove", help="stop sharing a folder (its ACL entries are removed)")
    sp.add_argument("source", metavar="SOURCE")
    sp.add_argument("--agent", "-a", default=DEFAULT, metavar="NAME")
    changes(sp)
    sp = msub.add_parser("list", help="list an agent's shares")
    sp.add_argument("--agent", "-a", default=DEFAULT, metavar="NAME")
    sp.add_argument("--json", action="store_true")

    sp = sub.add_parser("run", help="run a command as the agent, inside a cell")
    sp.add_argument("--agent", "-a", default=DEFAULT, metavar="NAME")
    sp.add_argument("--env", "-e", action="append", default=[], metavar="K=V", help="set a variable in the cell")
    sp.add_argument("-d", "--directory", metavar="DIR", help="working directory (default: here if shared, "
                    "else the agent's home)")
    sp.add_argument("--json", action="store_true", help="print one JSON result object as the last line")
    sp.add_argument("--verbose", "-v", action="store_true", help="print the agentcell run command it runs")
    sp.add_argument("command", nargs=REMAINDER, metavar="-- CMD")
    return p


def _confirm(question: str, yes: bool, dry_run: bool = False) -> None:
    if yes or dry_run:
        return
    if not sys.stdin.isatty():
        raise AgentcellError("--yes", "no terminal to ask for confirmation", "add --yes to proceed")
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    if sys.stdin.readline().strip().lower() not in ("y", "yes"):
        raise AgentcellError("", "cancelled; nothing was changed")


def main(argv: list[str]) -> int:
    ns = fast_parse(argv) or parser().parse_args(argv)
    try:
        return int(_dispatch(ns))
    except AgentcellError as e:
        return report(f"{PROG} {ns.cmd}", e)


def _dispatch(ns: Namespace | RunArgs) -> int:
    if isinstance(ns, RunArgs) or ns.cmd == "run":
        return run_as_agent(ns)
    if ns.cmd in ("list", "info"):
        return _list(ns) if ns.cmd == "list" else _info(ns)
    from .. import accounts as ac
    from ..accounts import accounts as acc

    cmds = ac.Commands(verbose=ns.verbose, dry_run=ns.dry_run) if "verbose" in ns else ac.Commands()
    if ns.cmd == "new":
        acc.check_name(ns.name)
        human = acc.resolve_human(ns.human)
        _confirm(f"Create agent account '{ns.name}' (group agentcell-{ns.name}, home /home/{ns.name}) shared "
                 f"with {human}?", ns.yes, ns.dry_run)
        try:
            rec = ac.new(ns.name, human=human, cmds=cmds)
        except AgentcellError as e:
            if not ns.dry_run and not isinstance(e, acc.AccountError):
                e.fix = f"what was made is recorded: 'agentcell agent delete {ns.name} --yes' removes it"
            raise
        if not ns.dry_run:
            print(f"created agent {rec.name} (uid {rec.uid}, group {rec.group}, home {rec.home}); {rec.human} is "
                  f"in {rec.group} from their next login (or 'newgrp {rec.group}')")
        return 0
    if ns.cmd == "delete":
        _confirm(f"Delete agent '{ns.name}' (kill its processes, remove its shares' ACLs, user and group"
                 f"{', and its home' if ns.delete_home else ''})?", ns.yes, ns.dry_run)
        problems = ac.delete(ns.name, delete_home=ns.delete_home, cmds=cmds)
        for p in problems:
            sys.stderr.write(f"{PROG} delete: not removed: {p}\n")
        if problems:
            sys.stderr.write(f"{PROG} delete: agent {ns.name} is kept as 'deleting'; fix the above and run it "
                             "again\n")
            return 1
        if not ns.dry_run:
            print(f"deleted agent {ns.name}" + ("" if ns.delete_home else " (its home was kept)"))
        return 0
    if ns.mount_cmd == "add":
        if ns.target is not None and os.path.abspath(ns.target) != os.path.abspath(ns.source):
            raise AgentcellError("TARGET", "a share appears in the cell at its own path only",
                                 "leave TARGET out (tools then see the same paths as you)")
        share = ac.mount_add(ns.agent, ns.source, ns.mode or "ro", cmds=cmds)
        if not ns.dry_run:
            print(f"shared {share.source} with {ns.agent} ({share.mode})")
        return 0
    if ns.mount_cmd == "remove":
        share = ac.mount_remove(ns.agent, ns.source, cmds=cmds)
        if not ns.dry_run:
            print(f"stopped sharing {share.source} with {ns.agent}")
        return 0
    with ac.open_registry() as reg:
        shares = reg.get(ns.agent).shares
    if ns.json:
        import json

        print(json.dumps([s.as_dict() for s in shares]))
    else:
        for s in shares:
            print(f"{s.source} [{s.mode}]")
    return 0


def _list(ns: Namespace) -> int:
    import json

    from ..accounts.status import listing

    got = listing()
    if ns.json:
        print(json.dumps(got))
        return 0
    if not got["agents"] and not got["session_accounts"]:
        print("no agents (create one with 'agentcell agent new')")
    for r in got["agents"]:
        print(f"{r['name']:<22} uid {r['uid']:<8} {r['state']:<9} human {r['human']:<12} {len(r['shares'])} shares, "
              f"{r['cells']} processes in cells")
    for a in got["session_accounts"]:
        print(f"{a['name']:<22} uid {a['uid']:<8} session account of {a['session_id']!r}")
    return 0


def _info(ns: Namespace) -> int:
    import json

    from ..accounts.status import report

    got = report(ns.name)
    if ns.json:
        print(json.dumps(got))
        return 0 if got["healthy"] else 1
    print(f"{got['name']}: {'healthy' if got['healthy'] else 'UNHEALTHY'}")
    print(f"  uid {got['uid']}, group {got['group']} ({got['gid']}), home {got['home']}, human {got['human']}")
    for s in got["shares"]:
        print(f"  share {s['source']} [{s['mode']}]")
    for c in got["checks"]:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['check']}: {c['detail']}")
    return 0 if got["healthy"] else 1
