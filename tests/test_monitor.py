"""The escape monitor (issue 7, first part): Landlock denials from the audit stream, resource events,
telemetry; freeze, record, kill."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from agentcell.monitor import audit
from conftest import AGENTCELL, User, agentcell_run, needs_root

pytestmark = needs_root

CONNECT = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 1))\nexcept OSError as e:\n"
           "    print('refused', e.errno)\nimport time; time.sleep(3); print('still running')")


def test_an_escape_attempt_is_attributed_and_ends_the_cell(user: User) -> None:
    before = audit.audit_enabled()
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "python3", "-c", CONNECT], timeout=60)
    assert r.rc == 137 and r.result["terminated_by_monitor"] is True, (r.out, r.err)
    assert "still running" not in r.out
    [ev] = r.result["events"]  # type: ignore[misc]
    assert (ev["operation"], ev["target"], ev["source"]) == ("network", "127.0.0.1:1", "landlock"), ev
    assert ev["pid"] and ev["exe"].endswith(("python3", "python3.11")) and ev["cell"] == r.result["cell_id"]
    assert "to allow it: --net loopback" in r.err and "frozen and killed" in r.err
    assert audit.audit_enabled() == before  # the audit switch is put back as it was


def test_record_only_lets_the_command_go_on(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--on-escape", "record", "--", "python3", "-c",
                       CONNECT], timeout=60)
    assert r.rc == 0 and r.out.split("\n") == ["refused 13", "still running"], r.out
    assert [e["target"] for e in r.result["events"]] == ["127.0.0.1:1"]  # type: ignore[union-attr]


def test_a_clean_workload_raises_no_event(user: User, project: Path) -> None:
    work = (f"cd {project} && git init -q && git -c user.name=a -c user.email=a@a.invalid add -A && "
            "git -c user.name=a -c user.email=a@a.invalid commit -qm one && git status --short && "
            "python3 -c 'import json, sqlite3, compileall; compileall.compile_dir(\".\", quiet=1)' && "
            "ls -la /usr/bin >/dev/null && tar -cf /tmp/t.tar . && cc --version >/dev/null 2>&1; true")
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--net", "loopback", "--monitor", "--",
                       "sh", "-c", work], timeout=120)
    assert r.rc == 0 and r.result["events"] == [], (r.result["events"], r.err)


def test_each_cell_sees_only_its_own_attempts(user: User) -> None:
    env = {"PATH": os.environ["PATH"]}
    calm = subprocess.Popen([AGENTCELL, "run", "--json", "--no-warm", "--as", str(user.uid), "--monitor", "--",
                             "sleep", "2"], stdout=subprocess.PIPE, text=True, env=env)
    loud = agentcell_run(["--as", str(user.uid), "--monitor", "--on-escape", "record", "--", "python3", "-c",
                          CONNECT], timeout=60)
    out, _ = calm.communicate(timeout=60)
    assert loud.result["events"] and json.loads(out.strip().splitlines()[-1])["events"] == []


def test_a_task_limit_hit_is_recorded_not_terminated(user: User) -> None:
    bomb = "for i in $(seq 40); do sleep 2 & done; wait; echo done"
    r = agentcell_run(["--as", str(user.uid), "--pids", "16", "--monitor", "--", "sh", "-c", bomb], timeout=60)
    assert r.result["terminated_by_monitor"] is False, r.err
    assert [e["target"] for e in r.result["events"]] == ["pids_limit_hits"], r.result["events"]  # type: ignore[union-attr]


def test_a_source_that_stops_is_a_telemetry_event_and_ends_the_cell(user: User) -> None:
    from agentcell import CellSpec
    from agentcell.cell import launch
    from agentcell.monitor.monitor import Monitor
    from agentcell.policy.resolve import build_env, resolve_identity

    ident = resolve_identity(str(user.uid), euid=0)
    spec = CellSpec(ident, env=build_env({}, ident), cell_id="agentcell-montest" + os.urandom(3).hex())
    watch = Monitor(spec.cell_id, None, uid=user.uid)
    running = launch.start(spec, ["sleep", "30"])
    watch.cg = running.cg
    watch.start()
    watch.audit.sock.close()  # the source dies under the monitor
    result = running.wait(20)
    events = watch.stop()
    assert result.signal == 9 and watch.terminated
    assert events and {e.operation for e in events} == {"telemetry"}, [e.line() for e in events]
    assert any("stopped" in e.reason or "failed" in e.reason for e in events)



def test_a_privilege_tool_run_in_the_cell_is_an_escape_attempt(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--on-escape", "record", "--", "sh", "-c",
                       "mount --version >/dev/null 2>&1; su -c true 2>/dev/null; echo done"], timeout=60)
    assert r.rc == 0 and r.out.strip() == "done", r.err
    got = [(e["operation"], e["target"], e["source"]) for e in r.result["events"]]  # type: ignore[union-attr]
    assert got == [("execute", "mount", "exec"), ("execute", "su", "exec")], r.result["events"]
