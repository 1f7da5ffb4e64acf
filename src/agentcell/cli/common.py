"""Argument parsing that fails with one line and agentcell's usage exit code, never a traceback."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from ..errors import EXIT_USAGE, MAX_LINE, printable


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        message = printable(message)
        if len(message) > MAX_LINE:  # argparse repeats the value it refused
            message = f"{message[:MAX_LINE * 2 // 3]}… ({len(message):,} characters)"
        sys.stderr.write(f"{self.prog}: {message} (see '{self.prog} --help')\n")
        sys.exit(EXIT_USAGE)

