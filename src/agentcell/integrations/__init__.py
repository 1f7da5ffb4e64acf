"""Agent frameworks on top of live cells: an MCP server (``agentcell[mcp]``) and a LangChain tool
(``agentcell[langchain]``). Optional extras: nothing on ``agentcell run``'s path imports them."""
