"""``agentcell mcp [RUN OPTIONS]``: an MCP server on stdio whose tools (run_command, read_file,
write_file, list_files) run inside one live cell built from ``agentcell run``'s options. Needs the
``agentcell[mcp]`` extra."""
from __future__ import annotations

import sys

from ..errors import AgentcellError, report

PROG = "agentcell mcp"


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(f"usage: {PROG} [--as WHO] [--rw PATH]... [--net MODE] [--no-monitor] [RUN OPTIONS]\n\n"
                         f"{__doc__}\n"
                         "The cell is watched, as every live cell's face is (Cell.open, the LangChain tool): the "
                         "first escape\nattempt ends it and the client is told why. --no-monitor runs it unwatched "
                         "(the kernel still\nrefuses the attempt; the cell carries on). --on-escape record keeps it "
                         "watched but running.\nThe rest are 'agentcell run' options ('agentcell run --help').\n\n"
                         "Add it to a client, e.g. Claude Code: claude mcp add agentcell -- agentcell mcp --rw $PWD\n")
        return 0
    watched = "--no-monitor" not in argv  # (a face of a live cell is watched unless told otherwise)
    argv = [a for a in argv if a != "--no-monitor"]
    from . import run

    try:
        try:
            from ..integrations import mcp_server
        except ImportError as e:
            raise AgentcellError("mcp", f"the MCP SDK is not installed ({e.name})",
                                 "pip install 'agentcell[mcp]'") from None
        ns = run.parse(argv, PROG)
        if ns.command:
            raise AgentcellError("command", "the MCP server takes none: its client sends the commands",
                                 "drop what follows --")
        if ns.timeout is not None:
            raise AgentcellError("--timeout", "is per command here", "the run_command tool takes timeout_s")
        from ..api import LiveCell

        if not watched and (ns.monitor or ns.on_escape):
            raise AgentcellError("--no-monitor", "contradicts --monitor/--on-escape", "drop one of them")
        cell = LiveCell.open(run.build_spec(ns), monitor=(ns.on_escape or "terminate") if watched else None)
    except AgentcellError as e:
        return report(PROG, e)
    try:
        mcp_server.serve(cell)
    finally:
        cell.close()
    return 0
