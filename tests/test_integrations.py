"""Live cells driven by real clients: the MCP SDK's own client over stdio against ``agentcell mcp``, and a
LangChain agent loop (LangGraph's prebuilt ReAct agent; the chat model is a scripted fake, named so: no
model API can be reached here) calling :class:`CellShellTool`."""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentcell import Cell, CellSpec
from agentcell.policy.resolve import build_env, resolve_identity
from conftest import AGENTCELL, User, needs_root

pytestmark = [needs_root,  # its replacement (langchain.agents) is another package; the loop is the same
              pytest.mark.filterwarnings("ignore:create_react_agent has been moved")]
VENV = str(Path(sys.executable).parent.parent)  # pytest runs in the cell from here, read-only


@pytest.fixture
def project(user: User, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("agentcell-live-project")
    (d / "test_sample.py").write_text("def test_adds():\n    assert 1 + 1 == 2\n")
    for p in (d.parent, d):
        os.chmod(p, 0o755)
    shutil.chown(d, user.uid, user.gid)
    shutil.chown(d / "test_sample.py", user.uid, user.gid)
    yield d


# ---- MCP ------------------------------------------------------------------------------------------------


def _mcp_session(args: list[str], steps: Any) -> Any:
    from mcp import ClientSession, StdioServerParameters, stdio_client

    async def go() -> Any:
        params = StdioServerParameters(command=AGENTCELL, args=["mcp", *args],
                                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
        async with stdio_client(params, errlog=open(os.devnull, "w")) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            return await steps(s)

    return anyio.run(go)


def _text(res: Any) -> str:
    return "".join(getattr(c, "text", "") for c in res.content)


def test_an_mcp_client_lists_the_tools_and_runs_pytest_in_a_live_cell(user: User, project: Path) -> None:
    async def steps(s: Any) -> list[Any]:
        tools = sorted(t.name for t in (await s.list_tools()).tools)
        wrote = await s.call_tool("write_file", {"path": str(project / "test_more.py"),
                                                 "content": "def test_more():\n    assert 'cell'\n"})
        listed = await s.call_tool("list_files", {"path": str(project)})
        ran = await s.call_tool("run_command", {"command": f"{VENV}/bin/python -m pytest -q -p no:cacheprovider",
                                                "cwd": str(project)})
        who = await s.call_tool("run_command", {"command": "id -u"})
        return [tools, wrote, listed, ran, who]

    tools, wrote, listed, ran, who = _mcp_session(
        ["--as", str(user.uid), "--rw", str(project), "--ro", VENV, "--monitor"], steps)
    assert tools == ["list_files", "read_file", "run_command", "write_file"]
    assert not wrote.is_error and "test_more.py" in _text(listed)
    assert not ran.is_error and "2 passed" in _text(ran) and _text(ran).startswith("exit status 0"), _text(ran)
    assert f"\n{user.uid}\n" in _text(who)
    assert (project / "test_more.py").stat().st_uid == user.uid  # written in the cell, as the agent


def test_an_escape_through_mcp_ends_the_cell_and_the_client_sees_why(user: User, project: Path) -> None:
    async def steps(s: Any) -> list[Any]:
        escaped = await s.call_tool("run_command", {"command": "cat ~/.ssh/id_rsa; sleep 5; echo survived"})
        after = await s.call_tool("read_file", {"path": str(project / "test_sample.py")})
        return [escaped, after]

    escaped, after = _mcp_session(["--as", str(user.uid), "--rw", str(project), "--monitor"], steps)
    assert escaped.is_error and "escape attempt" in _text(escaped) and "canary credential" in _text(escaped)
    assert "survived" not in _text(escaped)
    assert after.is_error and "has ended" in _text(after)


def test_mcp_watches_its_cell_unless_told_not_to(user: User, project: Path) -> None:
    """Watched by default, as Cell.open and the LangChain tool are: an escape attempt ends the cell.
    --no-monitor: the kernel still refuses it, and the cell carries on."""
    async def steps(s: Any) -> list[Any]:
        tried = await s.call_tool("run_command", {"command": "cat /etc/shadow; sleep 5; echo carried-on"})
        after = await s.call_tool("run_command", {"command": "echo still-here"})
        return [tried, after]

    tried, after = _mcp_session(["--as", str(user.uid), "--rw", str(project)], steps)
    assert tried.is_error and "escape attempt" in _text(tried) and "carried-on" not in _text(tried), _text(tried)
    assert after.is_error, _text(after)
    tried, after = _mcp_session(["--as", str(user.uid), "--rw", str(project), "--no-monitor"], steps)
    assert "Permission denied" in _text(tried) and "carried-on" in _text(tried), _text(tried)
    assert not after.is_error and "still-here" in _text(after), _text(after)


def test_mcp_bad_flag_is_one_line() -> None:
    import subprocess

    p = subprocess.run([AGENTCELL, "mcp", "--net", "bogus"], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 125 and "--net" in p.stderr and "Traceback" not in p.stderr


# ---- LangChain ------------------------------------------------------------------------------------------


def _agent(cell: Any, commands: list[str]) -> list[Any]:
    """LangGraph's prebuilt agent loop with a scripted fake chat model (it asks for each command, then
    ends), the cell's shell as its one tool; returns the conversation."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langgraph.prebuilt import create_react_agent

    from agentcell.integrations.langchain_tool import CellShellTool

    class ScriptedFakeModel(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kw: Any) -> Any:  # the script already names the tool
            return self

    script = [AIMessage(content="", tool_calls=[{"name": "shell", "args": {"command": c}, "id": f"call{i}"}])
              for i, c in enumerate(commands)] + [AIMessage(content="done")]
    agent = create_react_agent(ScriptedFakeModel(messages=iter(script)), [CellShellTool(cell=cell)])
    return list(agent.invoke({"messages": [("user", "work in the cell")]})["messages"])


def _spec(user: User) -> CellSpec:
    ident = resolve_identity(str(user.uid), euid=0)
    return CellSpec(identity=ident, env=build_env({}, ident), cwd=ident.home)


def test_a_langchain_agent_loop_calls_the_cell_tool(user: User) -> None:
    with Cell.open(_spec(user)) as cell:
        messages = _agent(cell, ["echo first > /tmp/kept; id -u", "cat /tmp/kept"])
    tool_out = [m.content for m in messages if m.type == "tool"]
    assert len(tool_out) == 2 and f"\n{user.uid}\n" in tool_out[0] and "\nfirst\n" in tool_out[1]
    assert messages[-1].content == "done"


def test_an_escape_through_the_langchain_tool_ends_the_cell_and_the_agent_sees_why(user: User) -> None:
    with Cell.open(_spec(user)) as cell:
        messages = _agent(cell, ["cat ~/.ssh/id_rsa; sleep 5; echo survived", "echo again"])
        assert cell.ended and "escape attempt" in cell.ended
    tool_out = [m.content for m in messages if m.type == "tool"]
    assert "escape attempt" in tool_out[0] and "survived" not in tool_out[0]
    assert "has ended" in tool_out[1]
