"""MkDocs hook: the CLI reference page (docs/cli.md) is written at build time from the parsers
themselves, so it cannot drift from what ``agentcell COMMAND --help`` says."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
from typing import Any

MARKER = "<!-- cli-reference -->"


def _helps(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, str]]:
    out = [(name, parser.format_help())]
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subcommands here, and only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub, p in action.choices.items():
                out += _helps(p, f"{name} {sub}")
    return out


def _help_of_main(module: Any, name: str) -> list[tuple[str, str]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        module.main(["--help"])
    return [(name, buf.getvalue())]


def reference() -> str:
    from agentcell.cli.main import COMMANDS, USAGE

    parts = ["## agentcell", "", "```text", USAGE.rstrip(), "```", ""]
    for cmd, (mod, _help) in COMMANDS.items():
        module = importlib.import_module(mod)
        helps = _helps(module.parser(), f"agentcell {cmd}") if hasattr(module, "parser") else \
            _help_of_main(module, f"agentcell {cmd}")
        for name, text in helps:
            parts += [f"## {name}" if name.count(" ") == 1 else f"### {name}", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, reference())
    return markdown
