"""``agentcell mcp [RUN OPTIONS]``: an MCP server on stdio whose tools (run_command, read_file,
write_file, list_files) run inside one live cell built from ``agentcell run``'s options. Needs the
``agentcell[mcp]`` extra."""
from __future__ import annotations

from ..errors import AgentcellError, report

TYPE_CHECKING = False  # see cell/spec.py
if TYPE_CHECKING:
    from .common import Parser

PROG = "agentcell mcp"


def parser() -> Parser:
    import argparse

    from . import run
    from .common import Parser

    options = run.parser(PROG)
    for action in options._actions:  # noqa: SLF001 - the one positional argparse gives no other way to reach
        if action.dest == "command":  # the client sends the commands: not a thing to offer here
            action.help = argparse.SUPPRESS
    p = Parser(prog=PROG, usage="%(prog)s [--as WHO] [--rw PATH]... [--net MODE] [--no-monitor] [RUN OPTIONS]",
               parents=[options], add_help=False, allow_abbrev=False,
               formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__,
               epilog="The cell is watched, as every live cell's face is (Cell.open, the LangChain tool): the first "
               "escape\nattempt ends it and the client is told why. --no-monitor runs it unwatched (the kernel "
               "still\nrefuses the attempt; the cell carries on). --on-escape record keeps it watched but running.\n"
               "The rest are 'agentcell run' options ('agentcell run --help').\n\n"
               "Add it to a client, e.g. Claude Code: claude mcp add agentcell -- agentcell mcp --rw $PWD")
    p.add_argument("--no-monitor", action="store_true", help="run the cell unwatched")
    return p


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    try:
        try:
            from ..integrations import mcp_server
        except ImportError as e:
            raise AgentcellError("mcp", f"the MCP SDK is not installed ({e.name})",
                                 "pip install 'agentcell[mcp]'") from None
        from ..api import LiveCell
        from . import run
        from .runargs import live_monitor

        monitor = live_monitor(ns, command_fix="drop what follows --: its client sends the commands",
                               timeout_fix="the run_command tool takes timeout_s")
        cell = LiveCell.open(run.build_spec(ns), monitor=monitor)
    except AgentcellError as e:
        return report(PROG, e)
    try:
        mcp_server.serve(cell)
    finally:
        cell.close()
    return 0
