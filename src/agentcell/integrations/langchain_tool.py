"""A LangChain tool (``langchain-core``) that runs shell commands in one live cell::

    with agentcell.Cell.open(policy) as cell:
        agent = create_react_agent(model, [CellShellTool(cell=cell)])

An escape ends the cell; the tool then answers every call with the reason (a ``ToolException`` the
agent loop shows the model, ``handle_tool_error``), so the loop can end instead of retrying outside."""
from __future__ import annotations

from typing import Any

from langchain_core.tools import BaseTool, ToolException
from pydantic import BaseModel, ConfigDict, Field

from . import tools


class ShellInput(BaseModel):
    command: str = Field(description="the shell command (sh -c), run in the project's sandboxed cell")
    timeout_s: float = Field(default=120.0, description="kill it after this many seconds")


class CellShellTool(BaseTool):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str = "shell"
    description: str = ("Run a shell command in a sandboxed Linux cell (agentcell) and get its exit status, stdout "
                        "and stderr. Only the project's declared paths are writable; leaving the cell ends it.")
    args_schema: type[BaseModel] = ShellInput
    handle_tool_error: bool = True
    cell: Any  # agentcell.api.LiveCell

    def _run(self, command: str, timeout_s: float = 120.0, **_: Any) -> str:
        try:
            return tools.run_command(self.cell, command, timeout_s)
        except tools.ToolFailed as e:
            raise ToolException(str(e)) from None
