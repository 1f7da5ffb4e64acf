"""``agentcell mcp``: an MCP server (the official ``mcp`` SDK, stdio transport) whose tools run commands
and read, write and list files inside one live cell. The cell is opened before the server answers,
closed when its client leaves; an escape ends it, and every later tool call says why."""
from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from ..api import LiveCell
from . import tools


def build(cell: LiveCell) -> Any:
    server = MCPServer("agentcell", instructions=(
        "Every tool runs inside one sandboxed Linux cell (agentcell): only the project's declared paths are "
        "writable, the network is the policy's, and an attempt to leave the cell ends it for good."))

    def call(fn: Any, *args: Any) -> str:
        try:
            return str(fn(cell, *args))
        except tools.ToolFailed as e:
            raise ToolError(str(e)) from None

    @server.tool(description="Run a shell command (sh -c) in the cell; returns its exit status, stdout and stderr.")
    def run_command(command: str, timeout_s: float = 120.0, cwd: str | None = None) -> str:
        return call(tools.run_command, command, timeout_s, cwd)

    @server.tool(description="Read a text file in the cell (at most 1 MiB).")
    def read_file(path: str) -> str:
        return call(tools.read_file, path)

    @server.tool(description="Write a text file in the cell (replacing it).")
    def write_file(path: str, content: str) -> str:
        return call(tools.write_file, path, content)

    @server.tool(description="List a directory in the cell (ls -la).")
    def list_files(path: str = ".") -> str:
        return call(tools.list_files, path)

    return server


def serve(cell: LiveCell) -> None:
    build(cell).run("stdio")
