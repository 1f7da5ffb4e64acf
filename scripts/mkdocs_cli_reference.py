"""MkDocs hook: the CLI reference page (docs/cli.md) is written at build time from the parsers
themselves, so it cannot drift from what ``agentcell COMMAND --help`` says."""
from __future__ import annotations

from typing import Any

MARKER = "<!-- cli-reference -->"


def reference() -> str:
    from agentcell.cli.common import commands, walk
    from agentcell.cli.main import USAGE

    parts = ["## agentcell", "", "```text", USAGE.rstrip(), "```", ""]
    for cmd, _summary, own in commands():
        if own is None:
            raise SystemExit(f"agentcell {cmd} has no parser(): its options cannot be documented")
        for words, p in walk(own, [cmd]):
            name, text = " ".join(["agentcell", *words]), p.format_help()
            parts += [f"## {name}" if name.count(" ") == 1 else f"### {name}", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, reference())
    return markdown
