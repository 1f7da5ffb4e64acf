"""A host process is a host process whatever its PID (issue 25): a cell's look at /proc/PID of a host process
is an escape attempt however the host's pids compare with the cell's pid counter, and a look at a number the
cell itself just gave up is a note.

Each case sets both counters through ``/proc/sys/kernel/ns_last_pid``: the host's, to start a host process
(the victim, standing in a directory of its own) at a pid of the test's choosing; the cell's (from a process
the test puts into the cell's pid namespace with nsenter), before the probe in the cell forks as often as the
case says and then reads the victim's working directory through /proc.
* a freshly booted host: the victim's pid is low, below the cell's counter and below the number of the cell's
  forks;
* a host whose pids went round pid_max: new host processes get low pids again, the cell's counter is high;
* a cell that forked more than pid_max times: its counter went round, past the victim's pid, which the cell
  never had;
* a number the cell just gave up: the cell's own child had the victim's pid in the cell's namespace, ended,
  and the probe looks at it (ps does this): a note.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import AGENTCELL, User, needs_root

pytestmark = needs_root

PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())  # the host's (a pid namespace has its own since 6.14)
PROBE = """
import os, sys
print("ready", flush=True)
sys.stdin.readline()
forks, victim = int(sys.argv[1]), int(sys.argv[2])
last = 0
for _ in range(forks):
    last = os.fork()
    if last == 0:
        os._exit(0)
    os.waitpid(last, 0)
print("last child", last, flush=True)
try:
    open(f"/proc/{victim}/cwd/notes.txt").read()
    print("READ IT")
except OSError as e:
    print("refused", e.errno, flush=True)
"""


def _in_ns(code: str, into: int | None) -> str:
    """Python ``code`` run in the host's pid namespace, or (``into``) in the one process ``into`` is in: the
    kernel's pid sysctls are those of the writer's own pid namespace."""
    argv = ["python3", "-c", code]
    if into is not None:  # (nsenter forks: its child is in the namespace)
        argv = ["nsenter", f"--target={into}", "--pid", "--", *argv]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def _set_last_pid(value: int, *, into: int | None = None) -> None:
    _in_ns(f"open('/proc/sys/kernel/ns_last_pid', 'w').write('{value}')", into)


def _free(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture
def secret_dir() -> Iterator[Path]:
    d = Path("/tmp") / f"agentcell-pids-{secrets.token_hex(4)}"
    d.mkdir(mode=0o755)
    (d / "notes.txt").write_text("a host process's file\n")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Victims:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, lo: int, hi: int, cwd: Path) -> int:
        """A host process standing in ``cwd``, at a pid in [lo, hi) (the host's counter set just before)."""
        for want in (p for p in range(lo, hi) if _free(p)):
            _set_last_pid(want - 1)
            p = subprocess.Popen(["sleep", "120"], cwd=cwd)
            self.procs.append(p)
            if lo <= p.pid < hi:
                return p.pid
            p.kill()  # another process of the host took that number first: the next one
        pytest.fail(f"no free host pid in [{lo}, {hi}) could be had")

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def victims() -> Iterator[Victims]:
    v = Victims()
    try:
        yield v
    finally:
        v.close()


def _probe(user: User, project: Path, *, counter: Callable[[int], int], forks: int, victim: int,
           code: str = PROBE) -> tuple[str, list[dict[str, object]], set[int]]:
    """The probe in a monitored cell (record only), its pid namespace's counter set to ``counter(its
    pid_max)`` first: (what it printed, the monitor's events, the numbers its forks were given)."""
    script = project / "probe.py"
    script.write_text(code)
    tag = f"agentcell-pids-{secrets.token_hex(3)}"
    p = subprocess.Popen([AGENTCELL, "run", "--json", "--no-warm", "--as", str(user.uid), "--rw", str(project),
                          "--monitor", "--on-escape", "record", "--", "python3", str(script), str(forks), str(victim),
                          tag],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={"PATH": os.environ["PATH"], "LANG": "C.UTF-8"})
    try:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        host_ns = os.readlink("/proc/self/ns/pid")  # (agentcell run's own command line names the tag too)
        probe = next(pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                     if tag.encode() in _cmdline(pid) and _pid_ns(pid) not in (None, host_ns))
        pid_max = int(_in_ns("print(open('/proc/sys/kernel/pid_max').read())", probe))
        start = counter(pid_max)
        _set_last_pid(start, into=probe)
        p.stdin.write("go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    lines = out.strip().splitlines()
    assert lines and lines[-1].startswith("{"), (out, err)
    result = json.loads(lines[-1])
    assert "READ IT" not in out, out
    given, n = set(), start  # the numbers the cell's namespace gave the forks (round its pid_max: from 300 again)
    for _ in range(forks):
        n = n + 1 if n + 1 < pid_max else 300
        given.add(n)
    assert not forks or f"last child {n}" in out, (out, n)
    return "\n".join(lines[:-1]), result["events"], given


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _seen(events: list[dict[str, object]], victim: int) -> list[tuple[object, object, object]]:
    return [(e["target"], e["acts"], e["source"]) for e in events if str(e["target"]).startswith(f"/proc/{victim}")]


# (name, the victim's pid range, the cell's counter before its forks, the forks): each victim pid is below the
# number of forks the cell made (the monitor's old count), and never one the cell's namespace gave out
CASES: list[tuple[str, tuple[int, int], Callable[[int], int], int]] = [
    ("a freshly booted host", (300, 600), lambda pid_max: 20_000, 700),
    ("a host whose pids went round pid_max", (300, 600), lambda pid_max: PID_MAX - 100, 700),
    # the cell's counter goes round its pid_max (to 300) and on to about 520: the victim lies above that
    ("a cell that forked past pid_max", (530, 600), lambda pid_max: pid_max - 400, 620),
]


@pytest.mark.parametrize(("victim_range", "counter", "forks"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_host_process_through_proc_is_an_attempt_whatever_its_pid(
        user: User, project: Path, secret_dir: Path, victims: Victims, victim_range: tuple[int, int],
        counter: Callable[[int], int], forks: int) -> None:
    victim = victims.start(*victim_range, cwd=secret_dir)
    out, events, given = _probe(user, project, counter=counter, forks=forks, victim=victim)
    assert "refused 2" in out and victim not in given, (out, victim)
    assert _seen(events, victim) == [(f"/proc/{victim}/cwd/notes.txt", True, "calls")], events


def test_a_number_the_cell_just_gave_up_is_a_note_though_a_host_process_has_it_too(
        user: User, project: Path, secret_dir: Path, victims: Victims) -> None:
    victim = victims.start(300, 2000, cwd=secret_dir)
    out, events, given = _probe(user, project, counter=lambda _: victim - 1, forks=1, victim=victim)
    assert given == {victim} and "refused 2" in out, out  # its child had that number
    assert _seen(events, victim) == [(f"/proc/{victim}", False, "calls")], events


STATUS_THEN_CWD_LATER = """
import os, sys, time
print("ready", flush=True)
sys.stdin.readline()
victim = int(sys.argv[2])
child = os.fork()
if child == 0:
    os._exit(0)
os.waitpid(child, 0)
print("child", child, flush=True)
time.sleep(float(sys.argv[1]))
for entry in ("status", "cwd/notes.txt"):
    try:
        open(f"/proc/{child}/{entry}").read()
    except OSError as e:
        print("refused", e.errno, flush=True)
"""


def test_long_after_the_cell_gave_a_number_up_a_look_at_it_is_its_own_and_a_reach_is_the_hosts(
        user: User, project: Path, secret_dir: Path, victims: Victims) -> None:
    from agentcell.monitor.pidns import RECENT_NS

    victim = victims.start(300, 2000, cwd=secret_dir)
    # the probe's own child takes the victim's number and ends; RECENT_NS later (by the kernel's clock, which
    # the monitor compares) the probe looks at that number as a pidfile's check would, then reaches into it
    out, events, _ = _probe(user, project, counter=lambda _: victim - 1, forks=0, victim=victim,
                            code=STATUS_THEN_CWD_LATER.replace("float(sys.argv[1])", str(RECENT_NS / 1e9 + 1)))
    assert f"child {victim}" in out and out.count("refused 2") == 2, out
    assert sorted(_seen(events, victim)) == [(f"/proc/{victim}", False, "calls"),
                                             (f"/proc/{victim}/cwd/notes.txt", True, "calls")], events


TAKEN_AFTER = """
import sys, threading, time
print("ready", flush=True)
sys.stdin.readline()
victim = int(sys.argv[2])
try:
    open(f"/proc/{victim}/status").read()
except OSError as e:
    print("refused", e.errno, flush=True)
hold = threading.Thread(target=time.sleep, args=(3,))
hold.start()
print("took", hold.native_id, flush=True)
hold.join()
"""


def test_a_number_the_cell_takes_only_after_its_look_does_not_clear_the_look(
        user: User, project: Path, secret_dir: Path, victims: Victims) -> None:
    victim = victims.start(300, 2000, cwd=secret_dir)
    out, events, _ = _probe(user, project, counter=lambda _: victim - 1, forks=0, victim=victim, code=TAKEN_AFTER)
    assert "refused 2" in out and f"took {victim}" in out, out
    assert _seen(events, victim) == [(f"/proc/{victim}/status", True, "calls")], (events, out)


EXEC_BY_A_THREAD = """
import os, sys, threading
print("ready", flush=True)
sys.stdin.readline()
victim = int(sys.argv[2])

def run():
    print("thread", threading.get_native_id(), flush=True)
    os.execv("/bin/sh", ["sh", "-c", f"cat /proc/{victim}/status >/dev/null 2>&1; echo refused $?"])

threading.Thread(target=run).start()
threading.Event().wait()
"""


def test_a_thread_that_execs_gives_its_number_up_and_a_look_at_it_is_a_note(
        user: User, project: Path, secret_dir: Path, victims: Victims) -> None:
    victim = victims.start(300, 2000, cwd=secret_dir)
    out, events, _ = _probe(user, project, counter=lambda _: victim - 1, forks=0, victim=victim,
                            code=EXEC_BY_A_THREAD)
    assert f"thread {victim}" in out and "refused 1" in out, out
    assert _seen(events, victim) == [(f"/proc/{victim}", False, "calls")], events
