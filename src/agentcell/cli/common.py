"""The commands' parsers: argument parsing that fails with one line and agentcell's usage exit code, never a
traceback, and the walk over every command's parser that completion, the docs and the tests share."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, NoReturn

from ..errors import EXIT_USAGE, MAX_LINE, printable

if TYPE_CHECKING:
    from collections.abc import Iterator


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        message = printable(message)
        if len(message) > MAX_LINE:  # argparse repeats the value it refused
            message = f"{message[:MAX_LINE * 2 // 3]}… ({len(message):,} characters)"
        sys.stderr.write(f"{self.prog}: {message} (see '{self.prog} --help')\n")
        sys.exit(EXIT_USAGE)



def commands() -> Iterator[tuple[str, str, Parser | None]]:
    """Each command's name, its line in ``agentcell --help`` and its parser (None for one with no ``parser()``)."""
    import importlib

    from .main import COMMANDS

    for name, (module, summary) in COMMANDS.items():
        own = getattr(importlib.import_module(module), "parser", None)
        yield name, summary, None if own is None else own()


def walk(parser: argparse.ArgumentParser, words: list[str]) -> list[tuple[list[str], argparse.ArgumentParser]]:
    """The parser and every subcommand's below it, each with the words that reach it."""
    found = [(words, parser)]
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subcommands here, and only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                found += walk(sub, [*words, name])
    return found
