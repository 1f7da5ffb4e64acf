"""Running a persistent agent: before each run its record is checked against the system (ready, its account
the one recorded, every share still the folder that was shared) and becomes the ``agentcell run`` arguments
that put the agent in a cell with its home and shares. Loads only the record: it runs per command."""
from __future__ import annotations

import pwd

from ..errors import AgentcellError
from .registry import AgentRecord, check_share, open_registry


def run_argv(name: str, command: list[str], *, env: list[str], directory: str | None,
             json: bool) -> tuple[AgentRecord, list[str]]:
    """The agent's record and the ``agentcell run`` arguments that run ``command`` as it."""
    with open_registry() as reg:
        rec = reg.get(name)
    if rec.state != "ready":
        raise AgentcellError("--agent", f"agent '{rec.name}' is {rec.state}, not ready",
                             f"'agentcell agent delete {rec.name} --yes' removes what was made")
    try:
        pw_uid = pwd.getpwnam(rec.name).pw_uid
    except KeyError:
        pw_uid = -1
    if pw_uid != rec.uid:
        raise AgentcellError("--agent", f"the account of agent '{rec.name}' is missing or changed",
                             f"see 'agentcell agent info {rec.name}'")
    argv = ["--as", f"agent:{rec.name}", "--home", rec.home]
    for s in rec.shares:
        why = check_share(rec, s)
        if why:
            raise AgentcellError("share", why, f"check it, then 'agentcell agent mount remove {s.source}' and add it "
                                 "again")
        argv += ["--rw" if s.mode == "rw" else "--ro", s.source]
    for e in env:
        argv += ["--env", e]
    if directory:
        argv += ["--cwd", directory]
    if json:
        argv.append("--json")
    return rec, [*argv, "--", *command]
