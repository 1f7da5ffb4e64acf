"""Holds under load (issue 13): on this 2-core machine many sessions at once, each busy with CPU and
forks, all complete with no telemetry event; a monitor that really stops still ends its cell (that one
is in test_monitor.py: a loop that hangs, a source that dies)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import AGENTCELL, needs_root
from sessionkit import Env, session_environ

pytestmark = needs_root

BUSY = """
import os, time
end = time.time() + 3
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        while time.time() < end:
            if os.fork() == 0:
                os._exit(0)
            os.wait()
            sum(range(20000))
        os._exit(0)
    kids.append(pid)
for k in kids:
    os.waitpid(k, 0)
with open(os.path.join({src!r}, "done-" + os.urandom(4).hex()), "w") as f:
    f.write("ok")
print("done")
"""


def test_twenty_busy_sessions_at_once_all_complete_with_no_telemetry_event(env: Env,
                                                                          tmp_path: Path) -> None:
    procs = []
    errs = [tmp_path / f"err-{i}.txt" for i in range(20)]  # files, not pipes: 20 stderrs read one at a time
    try:
        for err in errs:
            with err.open("w") as ef:
                procs.append(subprocess.Popen(
                    [AGENTCELL, "session", "start", "--harness", "shell", "--rw", "src", "--json", "--", "python3",
                     "-c", BUSY.format(src=str(env.project / "src"))], env=session_environ(env), cwd=env.project,
                    stdout=subprocess.PIPE, stderr=ef, text=True, stdin=subprocess.DEVNULL))
        outs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    summaries = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    ended = [(s["status"], s["reason"], errs[i].read_text()[-1500:]) for i, s in enumerate(summaries)
             if s["status"] != "completed" or s["exit_status"] != 0]
    assert not ended, ended
    shown = [json.loads(subprocess.run([AGENTCELL, "session", "show", s["session"], "--json"], capture_output=True,
                                       text=True, env=session_environ(env)).stdout.strip().splitlines()[-1])
             for s in summaries]
    telemetry = [e for st in shown for e in st.get("events") or [] if e["operation"] == "telemetry"]
    assert not telemetry, telemetry
    assert len(list((env.project / "src").glob("done-*"))) == 20
