"""Every privileged change agent accounts make is a real command, printed exactly as it would be typed.

``--verbose`` prints each one (to stderr, ``+ `` first, shell-quoted) before it runs; ``--dry-run``
prints them and runs nothing. Reading (``pwd``, ``grp``, ACL xattrs, ``/proc``) is not a change and
is done in Python. The commands are the standard tools (shadow's ``useradd``/``groupadd``/
``gpasswd``/``userdel``/``groupdel``, acl's ``setfacl``, util-linux's ``setpriv``), run with a fixed
PATH and a minimal environment, never through a shell.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

from ..errors import AgentcellError

ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


class CommandError(AgentcellError):
    """A privileged command failed; ``problem`` carries the command and what it said."""


class Commands:
    def __init__(self, *, verbose: bool = False, dry_run: bool = False) -> None:
        self.verbose, self.dry_run = verbose or dry_run, dry_run
        self.log: list[str] = []  # every command, as typed (for tests and reports)

    def note(self, text: str) -> None:
        """A change that is not a command (the registry): shown as a shell comment."""
        if self.verbose:
            sys.stderr.write(f"# {text}\n")

    def show(self, argv: Sequence[str]) -> None:
        """A change agentcell makes itself, on file descriptors (accounts/acl.py says why): printed as
        the command that does the same, run by no one."""
        line = shlex.join(argv)
        self.log.append(line)
        if self.verbose:
            sys.stderr.write(f"+ {line}  # done by agentcell, fd by fd\n")

    def run(self, argv: Sequence[str], *, check: bool = True,
            step: str = "") -> subprocess.CompletedProcess[str] | None:
        """Run ``argv``; None under --dry-run. A failure raises :class:`CommandError` naming ``step``."""
        line = shlex.join(argv)
        self.log.append(line)
        if self.verbose:
            sys.stderr.write(f"+ {line}\n")
            sys.stderr.flush()
        if self.dry_run:
            return None
        try:
            proc = subprocess.run(list(argv), env=ENV, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  errors="replace", cwd="/")
        except FileNotFoundError:
            raise CommandError(step or argv[0], f"{argv[0]} is not installed",
                               "install it (apt-get install passwd acl util-linux)") from None
        if check and proc.returncode != 0:
            said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            raise CommandError(step or argv[0], f"'{line}' failed ({said[-1] if said else f'exit {proc.returncode}'})")
        return proc


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise AgentcellError(what, "needs root (it creates accounts and changes ACLs)",
                             "run it through sudo")
