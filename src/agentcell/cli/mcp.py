"""``agentcell mcp [RUN OPTIONS]``: an MCP server on stdio whose tools (run_command, read_file,
write_file, list_files) run inside one live cell built from ``agentcell run``'s options. Needs the
``agentcell[mcp]`` extra."""
from __future__ import annotations

import sys

from ..errors import AgentcellError, report

PROG = "agentcell mcp"


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(f"usage: {PROG} [--as WHO] [--rw PATH]... [--net MODE] [--monitor] [RUN OPTIONS]\n\n"
                         f"{__doc__}\nAdd it to a client, e.g. Claude Code: claude mcp add agentcell -- agentcell mcp "
                         "--rw $PWD --monitor\n")
        return 0
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

        cell = LiveCell.open(run.build_spec(ns), monitor=ns.on_escape or "terminate" if ns.monitor else None)
    except AgentcellError as e:
        return report(PROG, e)
    try:
        mcp_server.serve(cell)
    finally:
        cell.close()
    return 0
