"""The escape monitor (issue 7): Landlock denials from the audit stream, exec watch, canary
credentials, seccomp refusals, resource events, telemetry; per-class verdicts; freeze, record, kill;
the rootless subset; the Python API. Every probe class under the monitor: tests/escape/test_monitor_probes.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agentcell.monitor import kaudit as audit
from conftest import AGENTCELL, User, agentcell_run, needs_root

pytestmark = needs_root

CONNECT = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 1))\nexcept OSError as e:\n"
           "    print('refused', e.errno)\nimport time; time.sleep(3); print('still running')")


def test_an_escape_attempt_is_attributed_and_ends_the_cell(user: User) -> None:
    before = audit.audit_enabled()
    backlog = audit.audit_status()[5]
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "python3", "-c", CONNECT], timeout=60)
    assert r.rc == 137 and r.result["terminated_by_monitor"] is True, (r.out, r.err)
    assert "still running" not in r.out
    events = r.result["events"]
    assert isinstance(events, list) and len(events) == 1, events
    ev = events[0]
    assert (ev["operation"], ev["target"], ev["source"]) == ("network", "127.0.0.1:1", "landlock"), ev
    assert ev["pid"] and ev["exe"].endswith(("python3", "python3.11")) and ev["cell"] == r.result["cell_id"]
    assert "to allow it: --net loopback" in r.err and "frozen and killed" in r.err
    assert audit.audit_enabled() == before  # the audit switch is put back as it was
    assert audit.audit_status()[5] == backlog  # and its backlog limit


# A cell renaming itself in a loop (PR_SET_NAME: one proc connector event a call, a microsecond each)
# while a child it forks tries a refused connect and exits at once: the flood once overflowed the
# connector, the child's fork was lost, and its denial was dropped as another process's.
FLOOD = ("import ctypes, os, socket, time\nlibc = ctypes.CDLL(None)\nkids = []\nfor _ in range(2):\n"
         "    pid = os.fork()\n    if pid == 0:\n        end = time.time() + 4\n        while time.time() < end:\n"
         "            for i in range(20000):\n                libc.prctl(15, b'a' if i & 1 else b'b', 0, 0, 0)\n"
         "        os._exit(0)\n    kids.append(pid)\ntime.sleep(1.5)\nif os.fork() == 0:\n    try:\n"
         "        socket.create_connection(('127.0.0.1', 1))\n    except OSError as e:\n"
         "        os._exit(e.errno)\n    os._exit(0)\nos.wait()\nfor k in kids:\n    os.waitpid(k, 0)\n"
         "print('still running')")


def test_a_flood_of_renames_hides_no_denial(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "python3", "-c", FLOOD], timeout=60)
    assert r.rc == 137 and "still running" not in r.out, (r.out, r.err)
    got = [(e["operation"], e["target"], e["source"]) for e in r.result["events"]]  # type: ignore[union-attr]
    assert ("network", "127.0.0.1:1", "landlock") in got, r.result["events"]
    assert not any("overflowed" in e["reason"] for e in r.result["events"]), r.result["events"]  # type: ignore


def _blind_cell(uid: int, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A monitored cell as ``uid`` whose proc connector is blind from the start: who its processes
    are can only come from the kernel's record of the Landlock domain that denied them."""
    from agentcell import CellSpec
    from agentcell.policy.resolve import build_env, resolve_identity
    from agentcell.supervise import Supervised

    ident = resolve_identity(str(uid), euid=0)
    spec = CellSpec(ident, env=build_env({}, ident), cell_id="agentcell-domtest" + os.urandom(3).hex())
    sup = Supervised.start(spec, argv, stdio=(os.open(os.devnull, os.O_RDWR),) * 3, dedicated=True)
    assert sup.monitor is not None and sup.monitor._execs is not None
    sup.monitor._execs.execs.read = lambda limit=8192: []  # type: ignore[method-assign]
    try:
        return sup.wait(30)
    finally:
        sup.terminate("cleanup")
        sup.wait(20)


def test_a_denial_is_the_cells_by_its_landlock_domain_with_no_fork_seen(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from agentcell.accounts import ephemeral

    monkeypatch.setenv("AGENTCELL_STATE_DIR", str(tmp_path / "state"))
    acct = ephemeral.create_ephemeral("dom-" + os.urandom(4).hex())  # a session's own account
    try:
        # The child is forked once the connector is blind.
        result = _blind_cell(acct.uid, ["sh", "-c", "sleep 1; python3 -c \"$0\"; echo still running", CONNECT],
                             monkeypatch)
    finally:
        ephemeral.delete(acct)
    assert result["terminated_by_monitor"] is True, result
    got = [(e["operation"], e["target"], e["source"]) for e in result["events"]  # type: ignore[union-attr]
           if e.get("acts", True)]  # (a note, say useradd replacing /etc/shadow on the host meanwhile, is not)
    assert got == [("network", "127.0.0.1:1", "landlock")], result["events"]


OUTSIDER = ("import ctypes, os, socket, struct, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "attr = struct.pack('QQ', 0, 2)  # handles net.connect_tcp, allows none\n"
            "fd = libc.syscall(444, attr, len(attr), 0)\nassert fd >= 0, ctypes.get_errno()\n"
            "libc.prctl(38, 1, 0, 0, 0)\nassert libc.syscall(446, fd, 0) == 0, ctypes.get_errno()\n"
            "time.sleep(float(sys.argv[1]))\ntry:\n    socket.create_connection(('127.0.0.1', 1))\n"
            "except OSError as e:\n    print('refused', e.errno, flush=True)\n")


def test_a_denial_outside_the_cell_is_never_the_cells(user: User, monkeypatch: pytest.MonkeyPatch) -> None:
    # A process of the same uid outside any cell makes a Landlock domain of its own and is denied
    # while the cell runs: a person's uid is not the cell's, and neither is a pid the kernel recorded
    # long ago (its number may be a cell's process by now).
    outside = subprocess.Popen([*user.prefix(), "/usr/bin/python3", "-c", OUTSIDER, "1.5"], stdout=subprocess.PIPE,
                               text=True)
    try:
        result = _blind_cell(user.uid, ["sleep", "3"], monkeypatch)
    finally:
        out, _ = outside.communicate(timeout=30)
    assert out.strip() == "refused 13", out
    assert result["terminated_by_monitor"] is False, result
    assert not [e for e in result["events"] if e.get("acts", True)], result["events"]  # type: ignore[union-attr]


def test_landlock_is_not_there_for_what_runs_in_a_cell(user: User) -> None:
    # A layer of the agent's own would hide its denials (the kernel logs the youngest denying layer,
    # with that layer's logging flags): in a cell, Landlock is "not there".
    probe = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
             "print(libc.syscall(444, None, 0, 1), ctypes.get_errno())")  # LANDLOCK_CREATE_RULESET_VERSION
    r = agentcell_run(["--as", str(user.uid), "--", "python3", "-c", probe])
    assert r.rc == 0 and r.out.strip() == "-1 38", (r.out, r.err)  # ENOSYS


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
    events = r.result["events"]
    assert isinstance(events, list)
    assert [e["target"] for e in events if e["acts"]] == ["pids_limit_hits"], events
    # the shell may give up on a refused fork with sleeps still running: those are noted as left behind
    assert all(e["reason"].startswith("a process still ran when the command ended") for e in events if not e["acts"])


def test_a_source_that_stops_is_a_telemetry_event_and_ends_the_cell(user: User) -> None:
    from agentcell import CellSpec
    from agentcell.cell import launch
    from agentcell.monitor.monitor import Monitor
    from agentcell.policy.resolve import build_env, resolve_identity
    from agentcell.protect.binds import for_cell

    ident = resolve_identity(str(user.uid), euid=0)
    spec = CellSpec(ident, env=build_env({}, ident), cell_id="agentcell-montest" + os.urandom(3).hex())
    watch = Monitor(spec.cell_id, None, uid=user.uid)
    running = launch.start(spec, ["sleep", "30"], guards=for_cell(spec))
    watch.attach(running)
    watch.start()
    landlock = next(s for s in watch._sources if s.name == "landlock")
    landlock.reader.sock.close()  # type: ignore[attr-defined]  # the source dies under the monitor
    result = running.wait(20)
    events = watch.stop()
    assert result.signal == 9 and watch.terminated
    assert events and {e.operation for e in events} == {"telemetry"}, [e.line() for e in events]
    assert any("stopped" in e.reason or "failed" in e.reason for e in events)



def _spin(release: threading.Event) -> None:
    while not release.is_set():
        sum(range(1000))  # on the CPU, and going nowhere: the thread is runnable all the while


@pytest.mark.parametrize("how", ["blocks", "spins"])
def test_a_monitor_loop_that_hangs_is_a_telemetry_event_and_ends_the_cell(user: User, how: str) -> None:

    from agentcell import CellSpec
    from agentcell.policy.resolve import build_env, resolve_identity
    from agentcell.supervise import Supervised

    ident = resolve_identity(str(user.uid), euid=0)
    spec = CellSpec(ident, env=build_env({}, ident), cell_id="agentcell-hangtest" + os.urandom(3).hex())
    sup = Supervised.start(spec, ["sleep", "30"], stdio=(os.open(os.devnull, os.O_RDWR),) * 3)
    assert sup.monitor is not None
    release = threading.Event()
    sup.monitor._resources.read = ((lambda: release.wait(30) and []) if how == "blocks"  # type: ignore[method-assign]
                                   else (lambda: _spin(release) or []))  # a source that blocks, or a loop that spins
    try:
        result = sup.wait(20)
    finally:
        release.set()
        sup.terminate("cleanup")
        sup.wait(20)
    assert result["signal"] == 9 and result["terminated_by_monitor"] is True, result
    events = result["events"]
    assert events[0]["target"] == "monitor" and "stopped reporting" in events[0]["reason"], events  # type: ignore[index]
    # A hung loop also lets the kernel's queues overflow on a busy host: more telemetry, nothing else.
    assert {e["operation"] for e in events} == {"telemetry"}, events  # type: ignore[union-attr]


def test_a_privilege_tool_run_in_the_cell_is_an_escape_attempt(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--on-escape", "record", "--", "sh", "-c",
                       "mount --version >/dev/null 2>&1; su -c true 2>/dev/null; echo done"], timeout=60)
    assert r.rc == 0 and r.out.strip() == "done", r.err
    events = r.result["events"]
    assert isinstance(events, list)
    got = [(e["operation"], e["target"], e["source"]) for e in events]
    assert got[:2] == [("execute", "mount", "exec"), ("execute", "su", "exec")], events
    # and what su went on to try, nosuid as it is: the shadow file, the failed-login log
    assert ("read", "/etc/shadow", "calls") in got[2:], events
    assert {os.path.basename(e["exe"]) for e in events[2:]} <= {"su"}, events


PTRACE = ("import ctypes, time; l = ctypes.CDLL(None, use_errno=True); print('ptrace', l.ptrace(16, 1, 0, 0), "
          "ctypes.get_errno(), flush=True); time.sleep(3); print('still running')")


def test_a_canary_credential_opened_is_attributed_and_ends_the_cell(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "sh", "-c",
                       "ls -a ~/.ssh; head -c 10 ~/.ssh/id_ed25519; sleep 3; echo still running"], timeout=60)
    assert r.rc == 137 and "still running" not in r.out, (r.out, r.err)
    assert "id_ed25519" in r.out and "id_rsa" in r.out  # listing the directory is not an attempt
    events = r.result["events"]
    assert isinstance(events, list) and len(events) == 1, events
    ev = events[0]
    assert (ev["operation"], ev["source"], ev["target"]) == ("read", "canary", f"/home/{user.name}/.ssh/id_ed25519")
    assert ev["pid"] and os.path.basename(ev["exe"]) == "head", ev
    assert r.result["monitor_sources"]["canary"] == "on"  # type: ignore[index]


def test_a_refused_escape_call_is_reported_by_seccomp_and_ends_the_cell(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "python3", "-c", PTRACE], timeout=60)
    assert r.rc == 137 and "still running" not in r.out, (r.out, r.err)
    events = r.result["events"]
    assert isinstance(events, list) and len(events) == 1, events
    ev = events[0]
    assert (ev["operation"], ev["source"], ev["target"]) == ("execute", "seccomp", "ptrace pid 1"), ev
    assert ev["exe"].startswith("/usr/bin/python3") and ev["pid"]


def test_without_the_monitor_the_same_call_is_refused_plainly(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--", "python3", "-c", PTRACE.replace("time.sleep(3)", "0")])
    assert r.rc == 0 and r.out.splitlines() == ["ptrace -1 1", "still running"], (r.out, r.err)
    assert "events" not in r.result


def test_verdicts_are_set_per_class(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--on-escape", "terminate,read=record", "--", "sh", "-c",
                       f"cat ~/.kube/config >/dev/null; echo read-went-on; python3 -c \"{PTRACE}\""], timeout=60)
    # ptrace waits in the call until the event is recorded and the cell frozen: it never returns
    assert r.rc == 137 and r.out.splitlines() == ["read-went-on"], (r.out, r.err)
    assert [e["source"] for e in r.result["events"]] == ["canary", "seccomp"]  # type: ignore[union-attr]


@pytest.mark.parametrize("flags", [["--on-escape", "kill"], ["--monitor", "--on-escape", "files=record"],
                                   ["--on-escape", "record"]])
def test_a_bad_verdict_is_one_line_and_nothing_runs(user: User, flags: list[str]) -> None:
    r = agentcell_run(["--as", str(user.uid), *flags, "--", "touch", "/tmp/x"])
    assert r.rc == 125 and len(r.err.strip().splitlines()) == 1 and "--on-escape" in r.err, r.err


def test_no_decoys_in_a_host_home_nor_in_a_shared_directory(user: User, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, user.uid, user.gid)
    r = agentcell_run(["--as", str(user.uid), "--home", str(home), "--monitor", "--", "sh", "-c", "ls -A ~"])
    assert r.rc == 0 and r.out == "" and list(home.iterdir()) == [], r.out
    assert r.result["monitor_sources"]["canary"].startswith("off: the home is a host directory")  # type: ignore[index]
    # A host directory shared at a decoy's place (or above it) gets no decoy and stays as it was:
    # nothing is written into a host directory, and its files are not watched.
    home_on_host = Path(f"/home/{user.name}")  # the account has none on disk: made here, removed below
    assert not home_on_host.exists()
    try:
        config = home_on_host / ".config"
        config.mkdir(parents=True)
        for d in (home_on_host, config):
            os.chown(d, user.uid, user.gid)
        r = agentcell_run(["--as", str(user.uid), "--rw", str(config), "--monitor", "--", "sh", "-c",
                           "ls -A ~ ~/.config; cat ~/.config/gh/hosts.yml 2>/dev/null; true"])
        assert r.rc == 0 and ".ssh" in r.out.split() and ".netrc" not in r.out.split(), (r.out, r.err)
        assert r.result["events"] == [] and list(config.iterdir()) == [], r.result
        assert "~/.config/gh/hosts.yml" not in r.out
    finally:
        shutil.rmtree(home_on_host, ignore_errors=True)


def test_rootless_says_what_it_cannot_see_and_uses_what_remains(user: User) -> None:
    r = agentcell_run(["--monitor", "--", "sh", "-c", f"cat ~/.aws/credentials >/dev/null; python3 -c \"{PTRACE}\""],
                      as_user=user, timeout=60)
    sources = r.result["monitor_sources"]
    assert {k: v.split(":")[0] for k, v in sources.items()} == {  # type: ignore[union-attr]
        "landlock": "off", "exec": "off", "cgroup": "off", "canary": "on (inotify", "seccomp": "on", "calls": "off",
        "created": "off", "masks": "off"}, sources  # the cell's PID 1 is out of an unprivileged caller's reach
    assert "not watched: calls" in r.err and "cgroup (off" in r.err and "audit stream needs root" in r.err
    # No cgroup to freeze: the cell is killed through its PID 1 at the first event (the canary).
    assert r.rc == 137 and "ptrace" not in r.out, (r.out, r.err)
    events = r.result["events"]
    assert isinstance(events, list) and len(events) == 1, events
    ev = events[0]
    assert (ev["source"], ev["pid"]) == ("canary", None)  # inotify: the open, not who made it
    r = agentcell_run(["--monitor", "--on-escape", "record", "--", "python3", "-c", PTRACE.replace("time.sleep(3)",
                       "0")], as_user=user, timeout=60)
    assert r.rc == 0 and [(e["source"], bool(e["pid"])) for e in r.result["events"]] == [  # type: ignore[union-attr]
        ("seccomp", True)], r.result


def test_the_python_api_streams_events_as_they_come(user: User) -> None:
    from agentcell import CellSpec
    from agentcell.policy.resolve import build_env, resolve_identity
    from agentcell.supervise import Supervised

    ident = resolve_identity(str(user.uid), euid=0)
    spec = CellSpec(ident, env=build_env({}, ident), cell_id="agentcell-apitest" + os.urandom(3).hex())
    seen: list[str] = []
    sup = Supervised.start(spec, ["sh", "-c", "cat ~/.kube/config ~/.ssh/id_rsa >/dev/null; sleep 30"],
                           monitor="record", callback=lambda ev: seen.append(ev.target),
                           stdio=(os.open(os.devnull, os.O_RDWR),) * 3)
    try:
        assert sup.monitor is not None
        stream = sup.monitor.stream(timeout=20)
        first, second = next(stream), next(stream)
        assert {first.target, second.target} == {f"/home/{user.name}/.kube/config", f"/home/{user.name}/.ssh/id_rsa"}
        assert first.pid and first.exe.endswith("/cat") and sup.poll() is None  # record: it runs on
        assert sup.stats()["cpu_s"] >= 0
        sup.terminate("the test is done")
        result = sup.wait(20)
    finally:
        sup.terminate("cleanup")
        sup.wait(20)
    assert result["signal"] == 9 and result["terminated_by_monitor"] is True
    assert sup.monitor.reason == "the test is done"
    assert sorted(seen) == sorted(e["target"] for e in result["events"])


def test_the_python_api_runs_a_watched_cell_and_its_monitor_acts(user: User) -> None:
    """Cell(spec).run runs a watched spec (the launcher forks it a cell host, where the monitor lives),
    and the first escape attempt ends that cell, as agentcell run --monitor does."""
    from agentcell import Cell, CellSpec
    from agentcell.policy.resolve import build_env, resolve_identity

    ident = resolve_identity(str(user.uid), euid=0)
    spec = CellSpec(ident, env=build_env({}, ident), watch=True)
    with Cell(spec) as cell:
        assert cell.run(["true"]).returncode == 0
        r = cell.run(["sh", "-c", "cat /etc/shadow; sleep 5; echo survived"], text=True)
    assert r.returncode == 137 and "survived" not in str(r.stdout), (r.stdout, r.stderr)


def test_a_denial_by_a_process_that_exits_at_once_is_still_attributed(user: User) -> None:
    # Each connect is made by a subshell that is gone before the record is read: the cell's
    # processes are known by descent, not by looking them up in /proc.
    work = "for p in 21 22 23 24 25; do (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; done; echo done"
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--on-escape", "record", "--", "bash", "-c", work],
                      timeout=60)
    assert r.rc == 0 and r.out == "done", r.err
    got = sorted(e["target"] for e in r.result["events"])  # type: ignore[union-attr]
    assert got == [f"127.0.0.1:{p}" for p in range(21, 26)], r.result["events"]


def test_a_busy_host_does_not_end_a_monitored_cell(user: User) -> None:
    # Another account forks and exits as fast as it can while the cell sleeps: the host's events are
    # not the cell's, and the monitor keeps up (or re-reads the cell's cgroup), but never kills it.
    flood = ("import os, time\nend = time.time() + 4\nwhile time.time() < end:\n    pid = os.fork()\n"
             "    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\n")
    floods = [subprocess.Popen([*user.prefix(), "python3", "-c", flood]) for _ in range(2)]
    try:
        r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "sh", "-c", "sleep 3; echo done"], timeout=60)
    finally:
        for p in floods:
            p.kill()
            p.wait()
    assert r.rc == 0 and r.out == "done" and r.result["terminated_by_monitor"] is False, (r.err, r.result)
    assert all(e["operation"] == "telemetry" and not e["acts"] for e in r.result["events"]), r.result["events"]


def test_a_watched_cell_without_a_monitor_is_refused(user: User) -> None:
    from agentcell import CellSpec
    from agentcell.errors import AgentcellError
    from agentcell.policy.resolve import build_env, resolve_identity
    from agentcell.supervise import Supervised

    ident = resolve_identity(str(user.uid), euid=0)
    with pytest.raises(AgentcellError, match="needs its monitor"):
        Supervised.start(CellSpec(ident, env=build_env({}, ident), watch=True), ["true"], monitor=None)


def test_a_mask_the_host_undoes_by_a_rename_ends_the_cell(user: User, tmp_path: Path) -> None:
    # An editor saving a masked .env (write a new file, rename it over) detaches the mask in every
    # cell: the kernel allows it. The monitor notices at once and ends the cell before it reads on.
    shared = tmp_path / "app"
    shared.mkdir()
    (shared / ".env").write_text("OLD-SECRET\n")
    (shared / "root.key").write_text("ROOT-ONLY\n")  # like /etc/shadow: unreadable to the agent anyway
    for p in (tmp_path, shared, shared / ".env"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    os.chmod(shared / "root.key", 0o600)
    work = (f"cat {shared}/.env 2>/dev/null || echo masked; echo ready; "
            f"for i in $(seq 100); do sleep 0.05; cat {shared}/.env 2>/dev/null; done; echo survived")
    p = subprocess.Popen([AGENTCELL, "run", "--json", "--no-warm", "--as", str(user.uid), "--ro", str(shared),
                          "--mask", f"{shared}/.env", "--mask", f"{shared}/root.key", "--monitor", "--", "sh", "-c",
                          work],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    try:
        first = p.stdout.readline() + p.stdout.readline()
        assert first == "masked\nready\n", first
        # useradd replaces /etc/shadow like this: the mask is gone, but the new file is root's 0600
        fd = os.open(shared / "root.key.new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"ROOT-ONLY-2\n")
        os.close(fd)
        os.rename(shared / "root.key.new", shared / "root.key")
        time.sleep(0.5)
        assert p.poll() is None  # noted, not held against the cell
        (shared / ".env.new").write_text("NEW-SECRET\n")
        os.chmod(shared / ".env.new", 0o644)
        os.rename(shared / ".env.new", shared / ".env")
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    result = json.loads(out.strip().splitlines()[-1])
    lines = out.splitlines()[:-1]
    assert p.returncode == 137 and "survived" not in lines, (out, err)
    # the first cat of the masked .env (a note: a path the policy masks), then the mask gone under a file
    # the account can read; the one it still cannot read (root.key, as /etc/shadow after a useradd) raises nothing
    assert [(e["source"], e["target"], e["acts"]) for e in result["events"]] == [
        ("calls", f"{shared}/.env", False), ("masks", f"{shared}/.env", True)], result["events"]
    # Between the rename and the freeze the cell may read the new file: a window of milliseconds
    # (the loop reads every 50 ms here); never more than a read or two.
    assert lines.count("NEW-SECRET") <= 2, lines


def test_a_flood_of_notes_never_pushes_out_an_event_that_acts() -> None:
    """The kept events are capped, notes and acting events apart: over a thousand distinct notes, then
    one refusal that acts, which is kept (the verdict never depended on the cap; the report does)."""
    from agentcell.monitor.loop import MAX_EVENTS
    from agentcell.monitor.monitor import Monitor

    m = Monitor("agentcell-test-cap", None, "record", rootless=True)  # no sources: fed by hand, as the proxy does
    try:
        m.record_egress([{"target": f"n{i}.example:80", "reason": "the name does not resolve", "source": "proxy",
                          "note": True} for i in range(MAX_EVENTS + 100)])
        m.record_egress([{"target": "evil.example:443", "reason": "not on the allow-list", "source": "proxy"}])
        acting = [e for e in m.events if e.acts]
        assert [e.target for e in acting] == ["evil.example:443"]
        overflow = [e for e in m.events if e.target == "notes"]
        assert len(overflow) == 1 and overflow[0].count == 100
        assert sum(1 for e in m.events if not e.acts) == MAX_EVENTS + 1
    finally:
        m.stop()


def test_an_attempt_found_after_the_cell_ended_still_ends_the_run_at_an_escape() -> None:
    """The monitor's last look, after the cell is over (a rootless watch learns of a decoy's open only
    after it; the proxy's last refusals are read after the monitor stops): nothing is left to freeze or
    kill, but the run ended at an escape attempt and says so. A source failing at teardown is a note."""
    from agentcell.monitor.event import CellEvent
    from agentcell.monitor.monitor import Monitor

    m = Monitor("agentcell-test-late", None, "terminate", rootless=True)
    m.stop()
    m._event(CellEvent("telemetry", "monitor", "a source failed: gone", source="telemetry", cell=m.cell_id))
    assert not m.terminated
    m.record_egress([{"target": "evil.example:443", "reason": "not on the allow-list", "source": "proxy"}])
    assert m.terminated and "evil.example:443" in m.reason and m.frozen_at is None
    r = Monitor("agentcell-test-late-record", None, "terminate,network=record", rootless=True)
    r.stop()
    r.record_egress([{"target": "evil.example:443", "reason": "not on the allow-list", "source": "proxy"}])
    assert not r.terminated and [e.target for e in r.events] == ["evil.example:443"]


def test_a_mask_whose_name_cannot_be_looked_up_does_not_blind_the_others(tmp_path: Path) -> None:
    from agentcell.monitor.masks import MaskWatch

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x").write_text("")
    watch = MaskWatch(os.getpid(), (str(tmp_path / "a" / "x"), str(tmp_path / "b" / "x")), os.getuid(), ())
    try:
        assert watch.check() == []
        (tmp_path / "a").rename(tmp_path / "a2")
        (tmp_path / "a").write_text("")  # a's name now fails with ENOTDIR (what an agent can do in its project)
        (tmp_path / "b" / "x").unlink()  # and the other mask's name no longer leads to it
        assert watch.check() == [(str(tmp_path / "b" / "x"), False)]
    finally:
        watch.close()


UDP_FLOOD = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor i in range(20000):\n"
             "    try:\n        s.sendto(b'x', ('127.0.0.1', 9))\n    except OSError:\n        pass\n"
             "print('done')")


def test_a_flood_of_refused_packets_is_counted_not_kept_one_by_one(user: User) -> None:
    # A person's uid: its refusals are recorded, not held against the cell, so the flood goes on.
    r = agentcell_run(["--as", str(user.uid), "--net", "host-firewall", "--monitor", "--", "python3", "-c",
                       UDP_FLOOD], timeout=120)
    assert r.rc == 0 and r.out.splitlines()[0] == "done", (r.out, r.err)
    blocked = r.result["egress_blocked"]
    assert isinstance(blocked, list) and 1 <= len(blocked) <= 2, blocked[:5]
    flood = next(e for e in blocked if e["target"] == "127.0.0.1:9")
    assert flood["count"] > 1000, flood  # (the kernel's queue may drop some: said in an entry of its own)


def test_a_protected_entry_the_command_creates_or_writes_is_reported_while_it_runs(user: User, project: Path) -> None:
    """Live, not only quarantined when the cell ends: the command waits for the test, which waits for the
    monitor's events (a created .claude, a write refused on the read-only .git/hooks)."""
    from agentcell import CellSpec
    from agentcell.policy.resolve import build_env, resolve_identity
    from agentcell.supervise import Supervised

    for d in (".git/hooks", ".git/objects", ".git/refs"):
        (project / d).mkdir(parents=True)
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(project)], check=True)
    go = project / "go"
    ident = resolve_identity(str(user.uid), euid=0)
    spec = CellSpec(ident, env=build_env({"HOME": ident.home}, ident), rw_paths=(str(project),))
    seen: list[str] = []
    script = (f"cd {project}; mkdir .claude; echo x > .git/hooks/pre-commit 2>/dev/null; "
              f"for i in $(seq 200); do [ -e {go} ] && exit 0; sleep 0.05; done; exit 3")
    null = os.open(os.devnull, os.O_RDWR)
    try:
        sup = Supervised.start(spec, ["sh", "-c", script], monitor="record", stdio=(null, null, null),
                               callback=lambda ev: seen.append(ev.target))
        for _ in range(200):
            if {f"{project}/.claude", f"{project}/.git/hooks/pre-commit"} <= set(seen):
                break
            time.sleep(0.05)
        live = list(seen)
        go.touch()
        result = sup.wait(30)
    finally:
        os.close(null)
    assert {f"{project}/.claude", f"{project}/.git/hooks/pre-commit"} <= set(live), live  # before the end
    assert result["exit_status"] == 0, result
    assert all(not e["acts"] and e["pid"] and e["exe"] for e in result["events"]), result["events"]
    assert f"{project}/.claude" in result["quarantined"], result  # and still moved aside at the end


def test_cat_etc_shadow_is_caught_and_ends_the_cell(user: User) -> None:
    """The issue's words: ``agentcell run --monitor -- cat /etc/shadow``. The cell masks it (an empty
    mode-000 file): cat's open fails with EACCES, which no Landlock record covers; the failed-call source
    names it, with cat and its parent."""
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "sh", "-c", "cat /etc/shadow; sleep 3; echo survived"],
                      timeout=60)
    assert r.rc == 137 and "survived" not in r.out, (r.out, r.err)
    [ev] = [e for e in r.result["events"] if e["acts"]]  # type: ignore[union-attr]
    assert (ev["operation"], ev["target"], ev["source"]) == ("read", "/etc/shadow", "calls"), ev
    assert os.path.basename(ev["exe"]) == "cat" and ev["ancestry"] and "by: PID 1 → dash" in r.err, (ev, r.err)


# The caller's own magic links lead where they lead: /proc/self/root is the cell's root (a cell cannot
# chroot), /proc/self/cwd its working directory, /proc/self/fd/N that fd's file; the monitor, which has no
# number in the cell's pid namespace, cannot read them itself (red team on issue 25). Each in a cell of its
# own: the process stays (asleep) until the monitor ends it, so its working directory and fds still read when
# the event is looked at (a process gone by then leaves a path through them unresolved: docs/status.md).
SELF_FORM = r"""
import os, sys, time
fd = os.open("/", os.O_RDONLY)
os.chdir("/")
path = sys.argv[1].replace("FD", str(fd))
try:
    open(path, "w" if path.endswith("planted") else "r").close()
except OSError:
    pass
time.sleep(120)
"""


@pytest.mark.parametrize("path,op,target", [
    ("/proc/self/root/root/.ssh/id_rsa", "read", "/root/.ssh/id_rsa"),
    ("/proc/thread-self/root/etc/shadow", "read", "/etc/shadow"),
    ("/proc/self/cwd/root/.aws/credentials", "read", "/root/.aws/credentials"),
    ("/proc/self/fd/FD/root/.netrc", "read", "/root/.netrc"),
    ("/proc/self/root/usr/bin/agentcell-planted", "write", "/usr/bin/agentcell-planted"),
], ids=["self_root", "thread_self_root", "self_cwd", "self_fd", "self_root_write"])
def test_the_callers_own_proc_links_are_followed_to_where_they_lead(user: User, path: str, op: str,
                                                                     target: str) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "python3", "-c", SELF_FORM, path], timeout=150)
    assert r.rc == 137 and r.result["terminated_by_monitor"] is True, (r.out, r.err, r.result)
    acting = [(e["operation"], e["target"]) for e in r.result["events"] if e["acts"]]  # type: ignore[union-attr]
    assert acting == [(op, target)], r.result["events"]


# A relative path from a process whose leader has ended (a zombie: its /proc/PID/cwd no longer reads): the
# working directory is the thread's own. The thread stays until the monitor ends the cell.
ZOMBIE_LEADER = r"""
import ctypes, os, threading, time
os.chdir("/")
def late():
    time.sleep(0.3)
    try:
        open("root/.ssh/id_rsa")
    except OSError:
        pass
    time.sleep(120)
    os._exit(0)
threading.Thread(target=late).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_relative_path_of_a_thread_whose_leader_has_ended_is_still_resolved(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "python3", "-c", ZOMBIE_LEADER], timeout=150)
    assert r.rc == 137 and r.result["terminated_by_monitor"] is True, (r.out, r.err, r.result)
    acting = [(e["operation"], e["target"]) for e in r.result["events"] if e["acts"]]  # type: ignore[union-attr]
    assert acting == [("read", "/root/.ssh/id_rsa")], r.result["events"]


# Threads made and ended as fast as Python can: their starts and ends fill the task ring, never the calls':
# no call is lost, nothing acts.
THREADS = r"""
import threading
for _ in range(30_000):
    batch = [threading.Thread(target=int) for _ in range(4)]
    for t in batch:
        t.start()
    for t in batch:
        t.join()
print("done", flush=True)
"""


def test_a_flood_of_threads_never_loses_a_call_nor_ends_the_cell(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--monitor", "--pids", "64", "--", "python3", "-c", THREADS],
                      timeout=300)
    assert r.rc == 0 and r.out.strip() == "done", (r.out, r.err)
    acting = [e for e in r.result["events"] if e["acts"]]  # type: ignore[union-attr]
    assert not acting and r.result["terminated_by_monitor"] is False, r.result["events"]


# A link in the project to a key outside the cell, read through: the open fails in the cell (ENOENT).
LINK_READ = r"""
import os, sys
os.symlink(sys.argv[2], sys.argv[1])
try:
    open(sys.argv[1]).read()
except OSError as e:
    print("refused", e.errno, flush=True)
"""


def test_a_link_read_through_is_seen_when_the_monitor_first_looks_after_the_cell_ended(
        user: User, project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded host: the monitor's loop is given no time before the cell's command has ended and its
    PID 1 has gone (here, the loop never runs: the monitor's last look is its first). The link is still
    followed where it stood in the cell, and the attempt still ends the run at an escape."""
    from agentcell import CellSpec
    from agentcell.monitor.loop import Loop
    from agentcell.policy.resolve import build_env, resolve_identity
    from agentcell.supervise import Supervised

    outside = Path("/tmp") / ("agentcell-test-key-" + os.urandom(4).hex())
    key = outside / "home" / ".ssh" / "id_ed25519"
    key.parent.mkdir(parents=True)
    key.write_text("a key\n")
    monkeypatch.setattr(Loop, "start", lambda self, run, check: None)
    ident = resolve_identity(str(user.uid), euid=0)
    spec = CellSpec(ident, env=build_env({}, ident), rw_paths=(str(project),),
                    cell_id="agentcell-late" + os.urandom(3).hex())
    null = os.open(os.devnull, os.O_RDWR)
    try:
        sup = Supervised.start(spec, ["python3", "-c", LINK_READ, str(project / "key-link"), str(key)],
                               stdio=(null, null, null), dedicated=True)
        result = sup.wait(60)
    finally:
        os.close(null)
        shutil.rmtree(outside, ignore_errors=True)
    assert result["exit_status"] == 0, result
    got = [(e["operation"], e["target"], e["source"], e["acts"]) for e in result["events"]]  # type: ignore[union-attr]
    assert ("read", str(key), "calls", True) in got, result["events"]
    assert result["terminated_by_monitor"] is True, result
