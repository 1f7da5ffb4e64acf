"""MkDocs hook: the CLI reference page (docs/cli.md) is written at build time from the parsers
themselves, so it cannot drift from what ``agentcell COMMAND --help`` says."""
from __future__ import annotations

import contextlib
import importlib
import io
from typing import Any

MARKER = "<!-- cli-reference -->"


def _help_of_main(module: Any, name: str) -> list[tuple[str, str]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        module.main(["--help"])
    return [(name, buf.getvalue())]


def reference() -> str:
    from agentcell.cli.common import commands, walk
    from agentcell.cli.main import COMMANDS, USAGE

    parts = ["## agentcell", "", "```text", USAGE.rstrip(), "```", ""]
    for cmd, _summary, own in commands():
        if own is None:  # a command whose --help its main prints
            helps = _help_of_main(importlib.import_module(COMMANDS[cmd][0]), f"agentcell {cmd}")
        else:
            helps = [(" ".join(["agentcell", *words]), p.format_help()) for words, p in walk(own, [cmd])]
        for name, text in helps:
            parts += [f"## {name}" if name.count(" ") == 1 else f"### {name}", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, reference())
    return markdown
