"""Live cells: one cell (namespaces, mounts, Landlock domain, monitor, proxy) that stays up and runs many
commands, from Python (``Cell.open``) and from the shell (``agentcell cell``)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from agentcell import Cell, CellSpec
from agentcell.api import CellEnded, LiveCell
from agentcell.policy.resolve import build_env, resolve_identity
from conftest import AGENTCELL, User, needs_root, proc_uid

pytestmark = needs_root
T = TypeVar("T")


def _spec(user: User, **kw: object) -> CellSpec:
    ident = resolve_identity(str(user.uid), euid=0)
    return CellSpec(identity=ident, env=build_env({"OPENAI_API_KEY": "sk-live-x"}, ident), cwd=ident.home, **kw)


@pytest.fixture
def live(user: User) -> Iterator[LiveCell]:
    with Cell.open(_spec(user)) as cell:
        yield cell


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def test_many_commands_share_one_cell(live: LiveCell, user: User) -> None:
    """The same mount namespace (a file one command writes, the next reads), PID namespace and Landlock
    domain (a command signals what an earlier one left running: sibling domains could not)."""
    assert live.exec(["sh", "-c", "echo kept > /tmp/x; (setsid sleep 300 & echo $! > /tmp/pid)"]).returncode == 0
    r = live.exec(["sh", "-c", "cat /tmp/x; kill $(cat /tmp/pid) && echo killed; id -u"], text=True)
    assert r.stdout == f"kept\nkilled\n{user.uid}\n", r.stderr
    assert r.cell_id == live.cell_id


def test_each_command_has_its_own_stdio_status_environment_and_directory(live: LiveCell) -> None:
    r = live.exec(["sh", "-c", "cat; echo oops >&2; echo $EXTRA; pwd; exit 3"], input="fed\n", env={"EXTRA": "one"},
                  cwd="/tmp", text=True)
    assert (r.returncode, r.stdout, r.stderr) == (3, "fed\none\n/tmp\n", "oops\n")
    r = live.exec(["sh", "-c", "echo ${EXTRA:-unset}; env"], text=True)
    assert str(r.stdout).startswith("unset\n")  # the policy's environment, scrubbed as in any cell
    assert "OPENAI_API_KEY" not in str(r.stdout)


def test_a_command_gets_only_its_stdio(live: LiveCell) -> None:
    r = live.exec(["sh", "-c", "ls /proc/self/fd"], text=True)
    assert str(r.stdout).split() == ["0", "1", "2", "3"]  # 3: ls's own listing of the directory


def test_the_exec_server_is_opaque_to_the_agent(live: LiveCell) -> None:
    """It runs as the agent's account but is non-dumpable: its memory (the launcher's image), fds and
    environment are not the agent's to read; under hidepid it is not even listed."""
    r = live.exec(["sh", "-c", "cat /proc/2/environ; ls /proc/2/fd; cat /proc/2/maps; ls /proc; echo done"],
                  text=True)
    listed = str(r.stdout).split()
    assert listed[-1] == "done" and "2" not in listed and "1" not in listed
    assert all(f"/proc/2/{f}" in str(r.stderr) for f in ("environ", "fd", "maps")), r.stderr


def test_timeout_kills_one_command_and_the_cell_goes_on(live: LiveCell) -> None:
    r = live.exec(["sleep", "30"], timeout=0.3)
    assert r.timed_out and r.returncode == 124
    assert live.exec(["true"]).returncode == 0


def test_not_found_is_127_with_a_line(live: LiveCell) -> None:
    r = live.exec(["no-such-command"], text=True)
    assert r.returncode == 127 and "command not found in the cell" in str(r.stderr)


def test_eight_commands_at_once(live: LiveCell) -> None:
    out: dict[int, str] = {}

    def one(i: int) -> None:
        out[i] = str(live.exec(["sh", "-c", f"sleep 0.5; echo {i}"], text=True).stdout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {i: f"{i}\n" for i in range(8)}
    assert time.monotonic() - start < 8 * 0.5  # they ran side by side, not one after another


def test_an_escape_by_one_command_ends_the_cell_for_every_caller(user: User) -> None:
    with Cell.open(_spec(user)) as cell:
        waiting = cell.spawn(["sleep", "60"], stdout=os.open(os.devnull, os.O_WRONLY))
        r = cell.exec(["sh", "-c", "cat ~/.ssh/id_rsa; sleep 5; echo survived"], text=True)
        assert r.returncode == 137 and "survived" not in str(r.stdout)
        assert r.error and "canary credential" in r.error
        assert waiting.wait(timeout=20) == 137 and "escape" in str(waiting.result["ended"])
        assert cell.ended and "escape attempt" in cell.ended
        assert any(e["acts"] and "id_rsa" in e["target"] for e in cell.events)
        with pytest.raises(CellEnded, match="canary credential"):
            cell.exec(["true"])
    assert cell.result is not None and cell.result["terminated_by_monitor"]
    assert _gone(cell.pid1)


def test_close_takes_everything_down(user: User) -> None:
    cell = Cell.open(_spec(user))
    cell.exec(["sh", "-c", "setsid sleep 300 &"])
    pid1, host = cell.pid1, cell.live._proc
    assert host is not None
    result = cell.close()
    assert result is not None and result["exit_status"] == 0 and not result["terminated_by_monitor"]
    assert host.poll() is not None and _gone(pid1)
    assert not Path(f"/run/agentcell/cgroups/{cell.cell_id}").exists()


def test_a_dead_host_takes_its_cell_with_it(user: User) -> None:
    cell = Cell.open(_spec(user))
    waiting = cell.spawn(["sleep", "60"], stdout=os.open(os.devnull, os.O_WRONLY))
    assert cell.live._proc is not None
    os.kill(cell.live._proc.pid, signal.SIGKILL)
    try:
        assert waiting.wait(timeout=20) == 137
        cell.close()
        for _ in range(200):
            if _gone(cell.pid1):
                break
            time.sleep(0.05)
        assert _gone(cell.pid1)
    finally:
        # A host killed outright cannot remove its cell's (empty) groups: the next cell's sweep does, once they
        # are stale; a test leaves none behind for the next test to find.
        from agentcell.cell import cgroups

        assert cgroups.remove_by_name(cell.cell_id) == []


def test_a_command_that_stops_the_exec_server_ends_its_own_cell(user: User) -> None:
    """The server runs as the agent's account, so a command can SIGSTOP it; then no request can end a
    command, so the host ends the whole cell (red team, helper 12: timeouts and stop hung for good)."""
    with Cell.open(_spec(user)) as cell:
        stopper = cell.spawn(["sh", "-c", "kill -STOP 2; sleep 1000"], stdout=os.open(os.devnull, os.O_WRONLY),
                             timeout=2)
        assert stopper.wait(timeout=30) == 137
        assert cell.ended and "no longer served commands" in cell.ended and "escape" not in cell.ended
    assert _gone(cell.pid1)


def _within(seconds: float, cell: LiveCell, fn: Callable[[], T]) -> T:
    """``fn()``, which must return within ``seconds``; else the cell is killed (so that the test fails,
    and does not hang) and the test fails."""
    out: list[T] = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        os.kill(cell.pid1, signal.SIGKILL)
        worker.join(30)
        pytest.fail(f"no answer within {seconds:g} s: the cell's host or exec server hung")
    return out[0]


def test_a_command_on_the_lane_that_stops_the_exec_server_ends_its_own_cell(user: User) -> None:
    """The private client's commands go on its lane, unseen by the host; the host still looks for a stopped
    exec server while the lane is open, so a command there that stops it (and one sent after) end with the
    cell, not hang."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        with Cell.open(_spec(user)) as cell:
            assert cell.live._lane is not None  # type: ignore[attr-defined]
            assert cell.exec(["true"]).returncode == 0  # (the server is up)
            server = int(Path(f"/proc/{cell.pid1}/task/{cell.pid1}/children").read_text().split()[0])
            stopper = cell.spawn(["sh", "-c", "kill -STOP 2; sleep 1000"], stdout=null, stderr=null)
            for _ in range(400):  # (the next is sent to a stopped server: it never takes it)
                if _gone(server) or Path(f"/proc/{server}/stat").read_text().split(")")[1].split()[0] == "T":
                    break
                time.sleep(0.05)
            after = cell.spawn(["true"], stdin=null, stdout=null, stderr=null)
            assert _within(30, cell, lambda: (stopper.wait(), after.wait())) == (137, 137)
            assert cell.ended and "no longer served commands" in cell.ended, cell.ended
        assert _gone(cell.pid1)
    finally:
        os.close(null)


def test_a_command_on_the_lane_ends_as_one_through_the_host(live: LiveCell) -> None:
    """The same requests on the lane (no timeout) and through the host (a timeout): the same environment,
    working directory, status, and words for one that never started; the lane takes no ``attach`` of its
    own (only the host's channel may give the server a lane)."""
    from agentcell.cell import execd

    lane = live.live._lane  # type: ignore[attr-defined]
    assert lane is not None
    script = 'echo "$A $HOME"; pwd; echo err >&2; exit 3'
    ways = [live.exec(["sh", "-c", script], env={"A": "b"}, cwd="/tmp", text=True, **kw)  # type: ignore[arg-type]
            for kw in ({}, {"timeout": 60})]
    assert ways[0].returncode == ways[1].returncode == 3
    assert ways[0].stdout == ways[1].stdout == f"b {lane.cwd}\n/tmp\n"
    assert ways[0].stderr == ways[1].stderr == "err\n"
    for argv, cwd in ((["no-such-command"], None), (["true"], "/nonexistent")):
        lost = [live.exec(argv, cwd=cwd, text=True, **kw) for kw in ({}, {"timeout": 60})]  # type: ignore[arg-type]
        assert lost[0].returncode == lost[1].returncode and lost[0].returncode in (126, 127)
        assert lost[0].stderr == lost[1].stderr and lost[0].stderr.startswith("agentcell: "), lost[0].stderr
    r, w = os.pipe()
    try:
        lane._send(execd.request({"op": "attach"}, [w]), [w])
    finally:
        os.close(w)
    assert live.exec(["true"]).returncode == 0 and live.ended is None
    assert os.read(r, 1) == b""  # the server closed the fd it was sent, unread: no second lane
    os.close(r)


def test_a_lane_whose_client_does_not_read_for_a_while_keeps_its_reports(user: User) -> None:
    """The exec server never waits on the lane: the ends its client has not taken yet (its reader busy or
    stopped) wait in the server, and go as it reads; the cell goes on (red team: it ended once some 280
    waited, as the socket's buffer was full)."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        with Cell.open(_spec(user), monitor=None) as cell:
            lane = cell.live._lane  # type: ignore[attr-defined]
            held, holding = threading.Event(), threading.Event()
            reports = lane.reports

            def late(drain: bool = False) -> list[dict[str, object]]:
                holding.set()
                held.wait(60)
                return reports(drain)

            assert cell.exec(["true"]).returncode == 0  # (the server is up)
            server = int(Path(f"/proc/{cell.pid1}/task/{cell.pid1}/children").read_text().split()[0])
            lane.reports = late
            cell.spawn(["true"], stdin=null, stdout=null, stderr=null)
            assert holding.wait(30)  # the reader thread is in it: nothing reads the lane (nor the host) now
            procs = [cell.spawn(["sh", "-c", f": > /tmp/r{i}"], stdin=null, stdout=null, stderr=null)
                     for i in range(600)]
            tmp = Path(f"/proc/{cell.pid1}/root/tmp")
            for _ in range(600):  # until all 600 have run and ended, their ends unread; or the server is gone
                if _gone(server) or (len(list(tmp.glob("r*"))) == 600 and not
                                     Path(f"/proc/{server}/task/{server}/children").read_text().split()):
                    break
                time.sleep(0.1)
            assert not _gone(server), "the exec server ended with its lane's reports unread"
            held.set()
            assert _within(60, cell, lambda: {p.wait() for p in procs}) == {0}
            assert cell.exec(["true"]).returncode == 0 and cell.ended is None
    finally:
        os.close(null)


class _Refusing:
    """A lane's socket whose sends fail as with too many fds in flight for the account (ETOOMANYREFS)."""

    def __init__(self, sock: object) -> None:
        self._sock = sock

    def sendmsg(self, *a: object) -> int:
        import errno

        raise OSError(errno.ETOOMANYREFS, os.strerror(errno.ETOOMANYREFS))

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def test_a_request_the_lane_cannot_send_goes_through_the_host(user: User) -> None:
    """Nothing of it sent, the server there (the account's fds in flight: a rootless cell's agent can park
    them): the host takes it, rather than the command waiting for an end that never comes. The lane's fd
    is not inherited by the client's children."""
    with Cell.open(_spec(user)) as cell:
        lane = cell.live._lane  # type: ignore[attr-defined]
        assert not os.get_inheritable(lane.fd)
        lane.sock = _Refusing(lane.sock)
        assert _within(30, cell, lambda: cell.exec(["sh", "-c", "echo hi"], text=True).stdout) == "hi\n"


def test_a_lane_send_a_signals_handler_cuts_short_shuts_the_lane() -> None:
    """A handler that raises (here TimeoutError, an OSError without errno) while a request is half sent:
    how much went cannot be known, so the lane is shut (the server reads its end, and ends with its
    cell) and the exception is the caller's; never taken as "refused, send it through the host" (it
    would run twice, or the server would read the next request as this one's rest)."""
    import signal as sig

    from agentcell.host.liveclient import _Lane

    ours, theirs = __import__("socket").socketpair()
    lane = _Lane(os.dup(ours.fileno()), {"env": {}, "cwd": "/"})
    ours.close()

    def late(*_: object) -> None:
        raise TimeoutError("the caller's own deadline")

    was = sig.signal(sig.SIGALRM, late)
    sig.setitimer(sig.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(TimeoutError):
            lane._send(b"x" * (4 << 20), [])  # (more than the socket holds: the send waits, part of it sent)
    finally:
        sig.setitimer(sig.ITIMER_REAL, 0)
        sig.signal(sig.SIGALRM, was)
    got = b""
    while chunk := theirs.recv(1 << 20):
        got += chunk
    assert 0 < len(got) < 4 << 20  # part of it went, then the lane's end
    theirs.close()
    lane.sock.close()


SIGPIPED = r"""
import os, signal, sys
from agentcell import Cell, CellSpec
from agentcell.api import CellEnded
from agentcell.policy.resolve import build_env, resolve_identity
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # (as many command-line tools set it)
null = os.open(os.devnull, os.O_RDWR)
ident = resolve_identity(sys.argv[1], euid=0)
cell = Cell.open(CellSpec(identity=ident, env=build_env({}, ident), cwd=ident.home))
cell.spawn(["sh", "-c", "sleep 0.3; kill -9 2"])
while True:  # (sends before, and after, the server's death, until the cell's end is known)
    try:
        cell.spawn(["sleep", "1"], stdin=null, stdout=null, stderr=null)
    except CellEnded:
        break
cell.close()
print("ended:", cell.ended)
"""


def test_a_client_that_lets_sigpipe_kill_it_survives_its_exec_servers_death(user: User) -> None:
    """A command kills the exec server while the client sends on the lane: the sends fail (EPIPE), the
    client is not killed by SIGPIPE (red team: 4 runs in 6), and its cell's end is said."""
    p = subprocess.run([sys.executable, "-c", SIGPIPED, str(user.uid)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "ended: the cell ended" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])


def test_a_close_while_commands_are_sent_ends_every_one_of_them(user: User) -> None:
    """``close`` while other threads send commands on the lane: each of them returns (137, or CellEnded),
    the cell is taken down whole, and the client's reader thread never dies of the lane's closing (red
    team: a traceback, and waiters left hanging, in 1 round of 12: a race this test may miss)."""
    from agentcell.cell.cgroups import groups_of

    died: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda a: died.append(a.exc_value)  # type: ignore[assignment]
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for _ in range(8):
            cell = Cell.open(_spec(user), monitor=None)
            codes: list[int] = []

            def send(cell: LiveCell = cell, codes: list[int] = codes) -> None:
                try:
                    while True:
                        codes.append(cell.spawn(["sleep", "10"], stdin=null, stdout=null, stderr=null).wait())
                except CellEnded:
                    pass

            senders = [threading.Thread(target=send, daemon=True) for _ in range(2)]
            for t in senders:
                t.start()
            time.sleep(0.1)
            cell.close()  # (not timeout=0: that kills the host, whose teardown then never runs)
            for t in senders:
                t.join(30)
            assert not any(t.is_alive() for t in senders), "a command of a closed cell never returned"
            assert set(codes) <= {137}
            assert groups_of(cell.cell_id) == []
    finally:
        threading.excepthook = hook
        os.close(null)
    assert died == []


def test_a_request_the_stopped_exec_server_cannot_take_never_hangs_its_host(user: User) -> None:
    """Requests larger than the exec server's channel holds, sent while a command has stopped the server:
    the host never blocks on it (it would serve nothing more, nor see the server stopped), and the cell
    ends as for any stopped server."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        with Cell.open(_spec(user)) as cell:
            stopper = cell.spawn(["sh", "-c", "kill -STOP 2; sleep 1000"], stdout=null, stderr=null)
            server = int(Path(f"/proc/{cell.pid1}/task/{cell.pid1}/children").read_text().split()[0])
            for _ in range(400):
                if Path(f"/proc/{server}/stat").read_text().split(")")[1].split()[0] == "T":
                    break
                time.sleep(0.05)
            # (more than the channel's buffer holds; a hung host takes its client's sends with it)
            big = _within(10, cell, lambda: [cell.spawn(["true"], env={"BIG": "x" * 150_000}, stdin=null,
                                                        stdout=null, stderr=null) for _ in range(4)])
            for _ in range(600):
                if stopper.poll() is not None:
                    break
                time.sleep(0.05)
            assert stopper.poll() == 137, "the host hung on a request the stopped server could not take"
            assert len(big) == 4 and all(p.wait(timeout=10) == 137 for p in big)
            assert cell.ended and "no longer served commands" in cell.ended, cell.ended
        assert _gone(cell.pid1)
    finally:
        os.close(null)


CATCH = r"""
import os, signal, time
pids = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)
last = int(os.pread(pids, 32, 0))
open("/tmp/catching", "w").close()
while True:  # each new process of the cell, stopped at once: kept stopped if it has not exec'd yet
    now = int(os.pread(pids, 32, 0))
    if now == last:
        continue
    last = now
    try:
        os.kill(now, signal.SIGSTOP)
        for _ in range(1000):  # (stopped for sure: a stop that lands in its exec takes effect after it)
            with open(f"/proc/{now}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] in ("T", "t"):
                break
        flags = int(fields[6])
    except (OSError, ValueError):
        continue
    if flags & 0x40:  # PF_FORKNOEXEC: spawned by the exec server, not exec'd: the server waits on it
        time.sleep(1000)
    os.kill(now, signal.SIGCONT)
"""


def test_a_command_stopped_between_its_spawn_and_its_exec_ends_its_cell(user: User) -> None:
    """The exec server spawns by vfork: a command stopped before its exec holds the server (state D, not T)
    for as long, and nothing more is served; the host ends the cell as for a stopped server (red team)."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        with Cell.open(_spec(user)) as cell:
            cell.spawn(["python3", "-c", CATCH], stdout=null, stderr=null)
            for _ in range(400):
                if Path(f"/proc/{cell.pid1}/root/tmp/catching").exists():
                    break
                time.sleep(0.05)

            def commands() -> list[int]:
                codes: list[int] = []
                while not codes or codes[-1] == 0:
                    codes.append(cell.exec(["true"]).returncode)
                return codes

            codes = _within(60, cell, commands)
            assert codes and codes[-1] == 137, f"{len(codes)} ran"
            assert cell.ended and "no longer served commands" in cell.ended, cell.ended
        assert _gone(cell.pid1)
    finally:
        os.close(null)


def test_a_command_the_agent_stops_after_its_exec_leaves_the_cell_serving(live: LiveCell) -> None:
    """The other side of the test above: a stopped command that has exec'd (a job stopped on purpose) holds
    nothing up, and is no reason to end the cell."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        stopped = live.spawn(["sleep", "1000"], stdout=null, stderr=null)
        assert live.exec(["sh", "-c", "kill -STOP $(pgrep -x sleep) && sleep 1"]).returncode == 0  # (4 looks)
        assert _within(30, live, lambda: live.exec(["true"]).returncode) == 0
        assert live.ended is None
        stopped.kill()
        assert stopped.wait(timeout=30) == 137
    finally:
        os.close(null)


def test_a_command_that_cuts_the_exec_servers_fds_ends_its_cell(user: User) -> None:
    """A command lowers the server's RLIMIT_NOFILE (prlimit: same account): the fds of the next request are
    cut off, and it can no longer match requests with their fds. It ends (and PID 1 the cell); it never
    waits for fds that will not come, serving nothing (red team)."""
    with Cell.open(_spec(user)) as cell:
        cut = "import resource; resource.prlimit(2, resource.RLIMIT_NOFILE, (3, 3))"
        assert cell.exec(["python3", "-c", cut]).returncode == 0
        code = _within(30, cell, lambda: cell.exec(["true"]).returncode)
        assert code == 137 and cell.ended, (code, cell.ended)
    assert _gone(cell.pid1)


def test_a_line_for_a_commands_stderr_never_holds_up_the_exec_server(live: LiveCell) -> None:
    """A command that cannot start, its stderr a pipe no one drains (its reader may be a command the agent
    stopped, or one holding the pipe's lock): the server serves on (red team: its own line to that stderr
    blocked it for good); the caller's side says why."""
    null = os.open(os.devnull, os.O_RDWR)
    r, w = os.pipe()
    try:
        os.set_blocking(w, False)
        while True:  # full
            try:
                os.write(w, b"x" * 4096)
            except BlockingIOError:
                break
        os.set_blocking(w, True)  # (a plain write to it waits)
        missing = live.spawn(["/nonexistent/" + "x" * 3000], stdin=null, stdout=null, stderr=w)
        assert _within(30, live, lambda: missing.wait()) == 127
        assert _within(30, live, lambda: live.exec(["true"]).returncode) == 0
        # (why it never ran is said by the caller's side: the server writes to no command's fds)
        assert str(missing.result["not_started"]).endswith("x: command not found in the cell"), missing.result
    finally:
        for fd in (null, r, w):
            os.close(fd)


LOADED = r"""
import os, resource, sys
from agentcell import Cell, CellSpec
from agentcell.policy.resolve import build_env, resolve_identity

resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))  # (the host's too)
ident = resolve_identity(sys.argv[1], euid=0)
null = os.open(os.devnull, os.O_RDWR)
with Cell.open(CellSpec(ident, env=build_env({}, ident), cwd=ident.home)) as cell:
    procs = [cell.spawn(["sleep", "1"], stdin=null, stdout=null, stderr=null) for _ in range(60)]
    print(sorted(set(p.wait(timeout=120) for p in procs)), cell.ended)
"""


def test_more_commands_at_once_than_the_exec_server_has_fds_for_wait_their_turn(user: User) -> None:
    """Each running command holds an fd of the exec server's: near its limit (64 here, from its host) it
    leaves the channel unread until one ends, so that no request's fds are cut off by its own load (which
    ends the server: see the test of a cut-off above)."""
    p = subprocess.run([sys.executable, "-c", LOADED, str(user.uid)], capture_output=True, text=True, timeout=300)
    assert p.stdout.split("\n")[0] == "[0] None", (p.stdout, p.stderr[-2000:])


@pytest.mark.parametrize("bad", [
    {"argv": ["tr\0ue"]}, {"env": {"A=B": "c"}}, {"env": {"A": "c\0d"}}, {"cwd": "relative"},
    {"timeout": float("inf")}, {"timeout": float("nan")}, {"timeout": -1},
])
def test_a_bad_request_is_refused_and_the_cell_serves_on(live: LiveCell, bad: dict[str, object]) -> None:
    from agentcell.errors import AgentcellError

    kw = {"argv": ["true"], **bad}
    argv = kw.pop("argv")
    with pytest.raises(AgentcellError, match="exec: "):
        live.exec(argv, **kw)  # type: ignore[arg-type]
    assert live.exec(["true"]).returncode == 0 and live.ended is None


def test_a_request_too_large_for_the_wire_is_said_so_and_the_cell_serves_on(live: LiveCell) -> None:
    """Not "the cell's host has gone": the host never had it, and the cell is fine."""
    from agentcell.errors import AgentcellError

    for size in (300_000, 2_000_000):  # (more than one datagram takes here; more than the wire takes at all)
        with pytest.raises(AgentcellError, match="more than one request to a live cell takes"):
            live.exec(["true"], env={"BIG": "y" * size})
    assert live.exec(["true"]).returncode == 0 and live.ended is None


def test_malformed_wire_requests_from_a_client_do_not_end_the_cell(user: User) -> None:
    """A same-uid client sending nonsense gets errors; the cell and other callers go on."""
    from agentcell.host import wire

    with Cell.open(_spec(user)) as cell:
        null = os.open(os.devnull, os.O_RDWR)
        for msg in ({"op": "exec", "id": "abc", "argv": ["true"]}, {"op": "exec", "id": 7, "env": [1, 2]},
                    {"op": "exec", "id": 8, "argv": ["true"], "timeout": "x"}, {"op": "signal", "id": 1, "sig": "x"},
                    {"op": "signal", "id": 1, "sig": 10**12}, {"op": "nonsense"}, {"id": 3}):
            wire.send(cell.live._sock, msg, [null, null, null])
        time.sleep(0.5)
        assert cell.ended is None and cell.exec(["true"]).returncode == 0


def test_a_working_directory_that_cannot_be_entered_is_said_so(live: LiveCell) -> None:
    r = live.exec(["pwd"], cwd="/nonexistent", text=True)
    assert r.returncode == 126 and "agentcell: /nonexistent:" in str(r.stderr)


# ---- the shell: agentcell cell --------------------------------------------------------------------------


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AGENTCELL, "cell", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def named(user: User) -> Iterator[str]:
    name = f"t{os.getpid()}"
    p = _cli("start", "--name", name, "--json", "--as", str(user.uid), "--monitor")
    assert p.returncode == 0, p.stderr
    host = json.loads(p.stdout)["host_pid"]
    try:
        yield name
    finally:
        _stop(name, host)


def _stop(name: str, host: int) -> None:
    """Stop a named cell the test started, and wait (bounded) for its host; killed if it is still there."""
    _cli("stop", "--name", name)
    for _ in range(100):
        if _gone(host):
            break
        time.sleep(0.05)
    else:
        os.kill(host, signal.SIGKILL)


def test_cli_start_exec_list_stop(named: str, user: User) -> None:
    p = _cli("exec", "--name", named, "--env", "X=1", "--", "sh", "-c", "echo $X; id -u; exit 5")
    assert (p.returncode, p.stdout) == (5, f"1\n{user.uid}\n")
    listed = json.loads(_cli("list", "--json").stdout)
    assert [c["name"] for c in listed if c["name"] == named] == [named]
    p = _cli("exec", "--name", named, "--timeout", "0.3", "--", "sleep", "30")
    assert p.returncode == 124 and "timed out" in p.stderr
    p = _cli("exec", "--name", named, "--", "no-such-command")
    assert (p.returncode, p.stderr) == (127, "agentcell: no-such-command: command not found in the cell\n")
    p = _cli("stop", "--name", named, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["exit_status"] == 0


def test_cli_many_clients_at_once_do_not_end_the_cell(named: str) -> None:
    import socket

    from agentcell.cli.cell import cells_dir

    conns = []
    try:
        for _ in range(200):  # past the host's limit (and past select's 1024 fds it would need for more)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(os.path.join(cells_dir(), f"{named}.sock"))
            conns.append(s)
    finally:
        for s in conns:
            s.close()
    p = _cli("exec", "--name", named, "--", "true")
    assert p.returncode == 0, p.stderr


def test_cli_escape_is_told_to_the_next_exec(named: str) -> None:
    p = _cli("exec", "--name", named, "--", "sh", "-c", "cat ~/.ssh/id_rsa; sleep 5; echo survived")
    assert p.returncode == 137 and "survived" not in p.stdout and "canary credential" in p.stderr
    p = _cli("exec", "--name", named, "--", "true")
    assert p.returncode == 137 and "has ended" in p.stderr and "canary credential" in p.stderr
    assert "ended: terminated at an escape attempt" in _cli("list").stdout


@pytest.mark.parametrize("args, field", [
    (["start", "--name", "Bad!"], "--name"),
    (["start", "--idle", "0"], "--idle"),
    (["start", "--timeout", "3"], "--timeout"),
    (["start", "--", "ls"], "command"),
    (["exec", "--name", "nobody-runs-this", "--", "true"], "--name"),
    (["exec", "--"], "command"),
    (["exec", "--env", "novalue", "--", "true"], "--env"),
    (["exec", "--timeout", "inf", "--", "true"], "--timeout"),
    (["frobnicate"], "unknown action"),
])
def test_cli_bad_input_is_one_line(args: list[str], field: str) -> None:
    p = _cli(*args)
    assert p.returncode == 125 and field in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr


def test_a_result_too_large_for_one_datagram_is_trimmed_not_lost() -> None:
    """The agent decides how many events a cell has (and how deep their ancestry): the host's last word
    must still arrive (red team, helper 13: a dropped 'ended' made the session see a lost host)."""
    import socket

    from agentcell.host import wire
    from agentcell.host.server import Host

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        host = Host(conn=theirs)
        # distinct strings: marshal shares equal ones
        events = [{"operation": "read", "target": f"/t{i}", "acts": False,
                   "ancestry": [[j, f"/{i}/{j}/" + "x" * 1000, "cmd"] for j in range(32)]} for i in range(300)]
        host._send(theirs, {"event": "ended", "reason": "r", "result": {"exit_status": 3, "events": events}})
        msg, _ = wire.recv(ours)
        assert msg is not None and msg["result"]["exit_status"] == 3
        assert len(msg["result"]["events"]) in (100, 10) and msg["result"]["trimmed"]["events"] >= 200
    finally:
        ours.close()
        theirs.close()


def test_an_adopted_firewall_table_is_recorded_as_its_new_owners(tmp_path: Path) -> None:
    from agentcell.network.firewall import HostFirewall

    record = tmp_path / "agentcell_x"
    record.write_text("1\n")
    HostFirewall("agentcell_x", str(record)).adopt()
    assert record.read_text() == f"{os.getpid()}\n"


def test_a_client_that_stops_reading_never_holds_up_the_monitor(user: User) -> None:
    """A live cell's events go to every client of its host; one that stops reading (a stopped `agentcell cell
    exec`, a program at a breakpoint) fills its socket. The next escape must still end the cell at once: the
    monitor never waits on a client (host/split.py). Before, its thread sent each event to every client
    itself, and blocked there: the escape below ran on, unfrozen, for as long as the client slept."""
    import socket

    from agentcell.host import wire

    name = f"t{os.getpid()}q"
    p = _cli("start", "--name", name, "--json", "--as", str(user.uid), "--on-escape", "terminate,write=record")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    host = int(info["host_pid"])
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        stuck.connect(info["socket"])
        wire.send(stuck, {"op": "status"})
        assert wire.recv(stuck)[0]["event"] == "status"  # a client now; it reads nothing more
        # 600 writes to the read-only system, each a distinct event (recorded: write=record), fill the stuck
        # client's socket many times over; then a canary credential is read (terminate).
        script = ("i=0; while [ $i -lt 600 ]; do touch /usr/agentcell-q$i 2>/dev/null; i=$((i+1)); done; "
                  "cat ~/.ssh/id_rsa >/dev/null; sleep 30; echo survived")
        r = _cli("exec", "--name", name, "--", "sh", "-c", script, timeout=120)
        assert r.returncode == 137 and "survived" not in r.stdout, (r.returncode, r.stderr[-400:])
        assert "canary credential" in r.stderr, r.stderr[-400:]
        # It reads again: every event waited for it, the escape among them, and the cell's end last
        # (red team: the backlog was sent only while the cell ran, and the end went behind it, never)
        _read_to_the_end(stuck, 601)
    finally:
        stuck.close()
        _stop(name, host)


def _read_to_the_end(sock: object, events: int) -> None:
    """Read ``sock`` (a client of a live cell's host) to the cell's ``ended``: at least ``events`` events
    came before it, a canary read among them, and the cell ended at that escape."""
    from agentcell.host import wire

    sock.settimeout(60)  # type: ignore[attr-defined]
    seen: list[dict[str, object]] = []
    while True:
        msg, _ = wire.recv(sock)  # type: ignore[arg-type]
        assert msg is not None, f"the host closed the connection before the end ({len(seen)} events came)"
        if msg.get("event") in ("escape", "note"):
            seen.append(msg["data"])
        elif msg.get("event") == "ended":
            break
    assert len(seen) >= events and any("canary" in str(e) for e in seen), (len(seen), seen[-3:])
    assert "terminated at an escape attempt" in str(msg["reason"]), msg["reason"]
    assert msg["result"]["terminated_by_monitor"] is True


def test_a_private_client_that_falls_behind_still_gets_every_event_and_the_end(user: User) -> None:
    """The client of a cell of its own (Cell.open) stops reading (a ^Z, a debugger) while the agent makes
    600 events and then an escape: what waits for it goes once it reads again, the cell's end last; before
    (red team), the host ended with it unsent and the client saw 'the cell's host died'."""
    import socket

    from agentcell.cell.spec import spec_to_dict
    from agentcell.host import interp, wire

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(interp.host("--conn", str(theirs.fileno())), pass_fds=[theirs.fileno()],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    theirs.close()
    null = os.open(os.devnull, os.O_RDWR)
    try:
        wire.send(ours, {"op": "open", "spec": spec_to_dict(_spec(user)), "monitor": "terminate,write=record",
                         "give_to": None})
        opened, _ = wire.recv(ours)
        assert opened is not None and opened.get("event") == "opened", opened
        script = ("i=0; while [ $i -lt 600 ]; do touch /usr/agentcell-p$i 2>/dev/null; i=$((i+1)); done; "
                  "cat ~/.ssh/id_rsa >/dev/null; sleep 30")
        wire.send(ours, {"op": "exec", "id": 1, "argv": ["sh", "-c", script], "env": {}, "cwd": None,
                         "timeout": None}, [null, null, null])
        for _ in range(1200):  # not read meanwhile: until the cell is gone
            if _gone(int(opened["pid1"])):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the cell did not end at the escape")
        _read_to_the_end(ours, 601)
    finally:
        os.close(null)
        ours.close()
        proc.wait(60)


def _relay_of(keeper: int) -> int:
    """The relay a named cell's host forked (host/split.py): its child in the host's pid namespace."""
    for child in Path(f"/proc/{keeper}/task/{keeper}/children").read_text().split():
        status = Path(f"/proc/{child}/status").read_text()
        nspid = next(ln for ln in status.splitlines() if ln.startswith("NSpid:")).split()[1:]
        if len(nspid) == 1:
            return int(child)
    raise AssertionError(f"no relay among the children of {keeper}")


@pytest.mark.parametrize("whom", ["relay", "keeper, lingering"])
def test_a_named_cells_host_in_two_processes_is_one_to_its_user(user: User, whom: str) -> None:
    """`cell list` names the host pid `cell start` said (the keeper's, not its relay's); a SIGTERM to either
    process stops the cell and removes its socket, also while an ended cell lingers (red team: the relay
    died of it outright and left the socket; a keeper stopped while its relay lingered left both)."""
    name = f"t{os.getpid()}s"
    p = _cli("start", "--name", name, "--json", "--as", str(user.uid), "--monitor")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    keeper, sock, cell_id = int(info["host_pid"]), Path(info["socket"]), info["cell_id"]
    try:
        listed = json.loads(_cli("list", "--json").stdout)
        assert [c.get("pid") for c in listed if c["name"] == name] == [keeper], listed
        relay = _relay_of(keeper)
        if whom == "relay":
            running = subprocess.Popen([AGENTCELL, "cell", "exec", "--name", name, "--", "sleep", "100"],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(600):  # until its command runs
                pids = [q for q in filter(str.isdigit, os.listdir("/proc")) if proc_uid(q) == user.uid]
                if any(_comm(q) == "sleep" for q in pids):
                    break
                time.sleep(0.05)
            os.kill(relay, signal.SIGTERM)
            _, err = running.communicate(timeout=60)
            assert running.returncode == 137 and "interrupted" in err, (running.returncode, err[-300:])
        else:
            r = _cli("exec", "--name", name, "--", "sh", "-c", "cat ~/.ssh/id_rsa; sleep 5")
            assert r.returncode == 137 and "canary credential" in r.stderr, r.stderr[-300:]
            assert sock.exists() and not _gone(relay)  # lingering: it says why the cell ended
            os.kill(keeper, signal.SIGTERM)
        for pid in (keeper, relay):
            for _ in range(600):
                if not Path(f"/proc/{pid}").exists() or _gone(pid):
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"{pid} is still there")
        assert not sock.exists()
        assert not Path(f"/run/agentcell/cgroups/{cell_id}").exists()
    finally:
        _stop(name, keeper)


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
