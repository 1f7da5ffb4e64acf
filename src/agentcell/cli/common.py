"""Argument parsing that fails with one line and agentcell's usage exit code, never a traceback."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from ..errors import EXIT_USAGE


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message} (see '{self.prog} --help')\n")
        sys.exit(EXIT_USAGE)

