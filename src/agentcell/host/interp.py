"""How agentcell starts a server of its own (the warm launcher, a cell host): a fresh interpreter that
imports nothing from its caller's working directory, PYTHONPATH or user site. A harness usually runs
inside the agent's project, and ``python -m`` would put that directory first on ``sys.path``, so a
planted ``agentcell/`` or ``json.py`` would run as the server (root). The package is found where the
caller found it."""
from __future__ import annotations

import os
import sys


def isolated(module: str, *args: str) -> list[str]:
    """argv that runs ``module.main(args)`` (its return value the exit status) that way."""
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"import sys; sys.path.insert(0, sys.argv[1]); from {module} import main; sys.exit(main(sys.argv[2:]))"
    return [sys.executable, "-I", "-c", code, pkg_parent, *args]


def launcher(*args: str) -> list[str]:
    """The warm launcher (:mod:`agentcell.host.zygote`)."""
    return isolated("agentcell.host.zygote", *args)


def host(*args: str) -> list[str]:
    """A cell host (:mod:`agentcell.host.server`)."""
    return isolated("agentcell.host.server", *args)
