"""`agentcell warm`: the per-user launcher `agentcell run` hands its cells to."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import AGENTCELL, User, agentcell_run, needs_root, proc_ppid

pytestmark = needs_root


@pytest.fixture
def runtime_dir(user: User) -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR for the throwaway user; the launcher a test started there is stopped,
    and, should stopping fail, ended by the pid it reported."""
    d = Path("/tmp") / ("agentcell-xdg-" + secrets.token_hex(4))
    d.mkdir(mode=0o700)
    shutil.chown(d, user.uid, user.gid)
    try:
        yield d
    finally:
        for p in (d, d / "agentcell"):
            if p.exists():
                os.chmod(p, 0o700)
        stop_launcher(user, d)
        shutil.rmtree(d, ignore_errors=True)


def stop_launcher(user: User, rt: Path) -> None:
    """Stop the launcher a test started in ``rt``; should that fail, end it by the pid it reported."""
    subprocess.run([*user.prefix(), "env", f"XDG_RUNTIME_DIR={rt}", AGENTCELL, "warm", "stop"], capture_output=True)
    for pid in STARTED.pop(str(rt), []):
        if _is_launcher(pid):
            os.kill(pid, signal.SIGKILL)


STARTED: dict[str, list[int]] = {}


def launcher_status(user: User, rt: Path) -> dict[str, Any]:
    p = subprocess.run([*user.prefix(), str(Path(AGENTCELL).parent / "python"), "-c",
                        "import json; from agentcell.host import warm; print(json.dumps(warm.status()))"],
                       env={"XDG_RUNTIME_DIR": str(rt), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    return dict(json.loads(p.stdout))


def _is_launcher(pid: int) -> bool:
    try:
        return b"agentcell.host.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def warm(user: User, rt: Path, *args: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([*user.prefix(), "env", f"XDG_RUNTIME_DIR={rt}", AGENTCELL, "warm", *args],
                       capture_output=True, text=True, timeout=60)
    if args[:1] == ("start",) and " pid " in p.stdout:
        STARTED.setdefault(str(rt), []).append(int(p.stdout.split(" pid ")[1].split(",")[0]))
    return p


def processes_with_argv(argv: list[bytes]) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[: len(argv)] == argv:
                found.append(int(pid))
        except OSError:
            continue
    return found


def kill_client_then_its_cell_ends(p: subprocess.Popen[str], tag: str) -> None:
    """``p``: an agentcell run (started by the test) whose command printed a line, then exec'd
    ``sleep TAG``. Kill the client; its cell must end (bounded polls, no timing asserted)."""
    argv = [b"sleep", tag.encode()]
    for _ in range(200):  # the line is printed just before the exec of sleep
        if processes_with_argv(argv):
            break
        time.sleep(0.05)
    assert processes_with_argv(argv)
    p.kill()
    p.wait()
    for _ in range(200):  # the launcher (or the cell's host) notices the closed connection and ends the cell
        if not processes_with_argv(argv):
            break
        time.sleep(0.05)
    assert not processes_with_argv(argv)


def test_run_goes_through_the_warm_launcher_and_confines_the_same(user: User, runtime_dir: Path,
                                                                  project: Path) -> None:
    assert warm(user, runtime_dir, "status").returncode == 1
    assert warm(user, runtime_dir, "start").returncode == 0
    env = {"XDG_RUNTIME_DIR": str(runtime_dir), "OPENAI_API_KEY": "sk-leak"}
    for _ in range(3):  # the first builds a cell, the next ones take the prepared cell
        r = agentcell_run(["--rw", str(project), "--", "sh", "-c",
                           f"id -u; echo w >> {project}/w.txt; env; echo x > /usr/x 2>/dev/null || echo RO"],
                          as_user=user, env=env, warm=True)
        assert r.rc == 0, r.err
        assert r.result["via"] == "warm launcher"
        assert r.out.splitlines()[0] == str(user.uid)
        assert "sk-leak" not in r.out and "RO" in r.out
    assert (project / "w.txt").read_text() == "w\n" * 3
    r = agentcell_run(["--no-warm", "--", "true"], as_user=user, env=env, warm=True)
    assert r.rc == 0 and r.result["via"] == "here"


def test_warm_exit_codes_timeout_and_errors_match_the_cold_path(user: User, runtime_dir: Path) -> None:
    warm(user, runtime_dir, "start")
    env = {"XDG_RUNTIME_DIR": str(runtime_dir)}
    r = agentcell_run(["--", "sh", "-c", "exit 9"], as_user=user, env=env, warm=True)
    assert r.rc == 9 and r.result["via"] == "warm launcher"
    r = agentcell_run(["--", "no-such-command-agentcell"], as_user=user, env=env, warm=True)
    assert r.rc == 127 and "not found" in r.err
    r = agentcell_run(["--timeout", "0.5", "--", "sleep", "30"], as_user=user, env=env, warm=True)
    assert r.rc == 124 and r.result["timed_out"] is True


def test_signal_to_the_client_reaches_the_command(user: User, runtime_dir: Path) -> None:
    warm(user, runtime_dir, "start")
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime_dir)}
    p = subprocess.Popen([*user.prefix(), AGENTCELL, "run", "--", "sh", "-c", "echo up; exec sleep 30"],
                         env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "up\n"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + signal.SIGTERM


def test_a_client_that_dies_takes_its_cell_with_it(user: User, runtime_dir: Path) -> None:
    warm(user, runtime_dir, "start")
    tag = f"{secrets.randbelow(10**6)}.5"
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime_dir)}
    p = subprocess.Popen([*user.prefix(), AGENTCELL, "run", "--", "sh", "-c", f"echo up; exec sleep {tag}"],
                         env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "up\n"
    kill_client_then_its_cell_ends(p, tag)


def _threads_and_children(pid: int) -> tuple[int, list[int]]:
    threads = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("Threads:")))
    children = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    return threads, children


def test_a_monitored_run_is_served_by_a_cell_host_the_launcher_forks(user: User, runtime_dir: Path) -> None:
    """The launcher forks a host for a supervised cell (its monitor's threads live there) and stays
    single-threaded; the result and what the CLI says are the cold path's."""
    warm(user, runtime_dir, "start")
    [launcher] = STARTED[str(runtime_dir)]
    env = {"XDG_RUNTIME_DIR": str(runtime_dir)}
    argv = ["--monitor", "--", "sh", "-c", "cat ~/.aws/credentials >/dev/null; sleep 3; echo still running"]
    results = {how: agentcell_run(argv, as_user=user, env=env, warm=how == "warm") for how in ("warm", "cold")}
    for how, r in results.items():
        assert r.rc == 137 and "still running" not in r.out, (how, r.out, r.err)
        assert r.result["via"] == ("warm launcher" if how == "warm" else "here")
        assert [e["source"] for e in r.result["events"]] == ["canary"], (how, r.result)  # type: ignore[union-attr]
        assert "killed at the first escape attempt" in r.err and "cgroup (off" in r.err, (how, r.err)
    warm_r, cold_r = results["warm"], results["cold"]
    assert warm_r.result["monitor_sources"] == cold_r.result["monitor_sources"]
    for _ in range(200):  # the host it forked has ended with its cell (a front's next CLI may wait there)
        threads, children = _threads_and_children(launcher)
        children = [c for c in children if c != launcher_status(user, runtime_dir)["cli_ahead"]]
        if not children:
            break
        time.sleep(0.05)
    assert (threads, children) == (1, [])


def test_a_client_killed_mid_run_ends_its_supervised_cell(user: User, runtime_dir: Path) -> None:
    """A proxied cell through the launcher: its host fails closed when the client goes."""
    warm(user, runtime_dir, "start")
    tag = f"{secrets.randbelow(10**6)}.7"
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime_dir)}
    p = subprocess.Popen([*user.prefix(), AGENTCELL, "run", "--net", "proxy", "--", "sh", "-c",
                          f"echo \"up $HTTPS_PROXY\"; exec sleep {tag}"], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "up http://127.0.0.1:3128\n"
    kill_client_then_its_cell_ends(p, tag)


def test_a_launcher_that_dies_mid_run_still_gets_the_protected_path_check(user: User, runtime_dir: Path,
                                                                            project: Path) -> None:
    """The cell dies with the launcher; the CLI says so in one line and still moves aside what the
    command created that decides what an agent runs."""
    warm(user, runtime_dir, "start")
    [launcher] = STARTED[str(runtime_dir)]
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime_dir)}
    planted = project / ".claude" / "settings.json"
    p = subprocess.Popen([*user.prefix(), AGENTCELL, "run", "--rw", str(project), "--", "sh", "-c",
                          f"mkdir {project}/.claude && echo '{{}}' > {planted}; echo up; exec sleep 30"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "up\n"
    os.kill(launcher, signal.SIGKILL)  # started by this test (STARTED)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 125 and "went away while the command ran" in err, err
    assert not planted.exists() and "moved to" in err and "/.claude" in err, err


FAKE_LAUNCHER = """
import _socket, os, sys
s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
s.bind(sys.argv[1]); s.listen(4); print("listening", flush=True)
c, _ = s._accept(); c = _socket.socket(fileno=c)
c.settimeout(5)
try:
    data = c.recvmsg(1 << 20, 1024)[0]
except OSError:
    data = b""
open(sys.argv[2], "w").write(str(len(data)))
"""


def nothing_reaches_an_impostor(user: User, runtime_dir: Path, impostor: list[str], run_args: list[str]) -> None:
    """Something that is not the caller's launcher listens where it would (``impostor``: the argv prefix
    that starts FAKE_LAUNCHER); the run is built by the CLI itself, and the listener got nothing."""
    sock_dir = runtime_dir / "agentcell"
    sock_dir.mkdir(mode=0o700)
    shutil.chown(sock_dir, user.uid, user.gid)
    got = runtime_dir / "got"
    fake = subprocess.Popen([*impostor, "-c", FAKE_LAUNCHER, str(sock_dir / "launcher.sock"), str(got)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None and fake.stdout.readline() == "listening\n"
        os.chmod(sock_dir / "launcher.sock", 0o777)  # (a root impostor's: the caller may connect)
        r = agentcell_run([*run_args, "--", "echo", "real"], as_user=user, env={"XDG_RUNTIME_DIR": str(runtime_dir)},
                          warm=True)
        assert r.rc == 0 and r.out == "real" and r.result["via"] == "here", (r.out, r.err, r.result.get("via"))
        fake.wait(timeout=20)
        assert got.read_text() == "0", "the client sent its request to something that is not its launcher"
    finally:
        if fake.poll() is None:
            fake.kill()
            fake.wait()


def test_a_launcher_inside_another_namespace_is_never_handed_a_command(user: User, runtime_dir: Path) -> None:
    """What a rootless cell (our uid) could set up where our launcher would listen: the client sees
    its peer is not in its own namespaces and builds the cell itself; nothing is sent there."""
    nothing_reaches_an_impostor(user, runtime_dir, [*user.prefix(), "unshare", "--user", "python3"], ["--monitor"])


def test_a_malformed_request_is_refused_and_the_launcher_serves_on(user: User, runtime_dir: Path) -> None:
    warm(user, runtime_dir, "start")
    # (a front's request: the command line with its working directory and stdio; here with a key too many,
    # with a command it does not hand over, and with floats that grow as they are sent on to a CLI process)
    cli = "{'op': 'cli', 'argv': [b'run', b'--', b'true'], 'env': [], 'umask': 18}"
    code = ("import _socket, os, sys; from agentcell.host import wire\n"
            f"cli = {cli}\n"
            "for msg in ({'op': 'spawn', 'id': 'x'}, {'op': 'signal', 'id': 1, 'sig': 'TERM'}, dict(cli, x=1),\n"
            "            dict(cli, argv=[b'doctor']), dict(cli, x=[0.5] * 100000)):\n"
            "    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET); s.connect(sys.argv[1])\n"
            "    s.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, 1 << 21)\n"
            "    fds = [os.open('/', os.O_RDONLY)] + [os.open(os.devnull, os.O_RDWR) for _ in range(3)]\n"
            "    wire.send(s, msg, fds if msg['op'] == 'cli' else None); print(wire.recv(s)[0]['event'])\n")
    p = subprocess.run([*user.prefix(), str(Path(AGENTCELL).parent / "python"), "-c", code,
                        str(runtime_dir / "agentcell" / "launcher.sock")], capture_output=True, text=True)
    assert p.stdout.split() == ["error", "error", "refused", "refused", "refused"], p.stdout + p.stderr
    assert warm(user, runtime_dir, "status").returncode == 0


def test_launcher_serves_only_its_own_uid(user: User, runtime_dir: Path) -> None:
    warm(user, runtime_dir, "start")
    # Open the door on purpose (a careless chmod): the launcher itself must still refuse another uid.
    os.chmod(runtime_dir, 0o755)
    os.chmod(runtime_dir / "agentcell", 0o755)
    os.chmod(runtime_dir / "agentcell" / "launcher.sock", 0o777)
    code = ("import _socket, sys; from agentcell.host import wire\n"
            "s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET); s.connect(sys.argv[1])\n"
            "try:\n    wire.send(s, {'op': 'status'})\n    msg, _ = wire.recv(s)\n"
            "except OSError:  # closed on us before or after the send (timing): refused either way\n"
            "    msg = None\nprint('ANSWERED' if msg else 'REFUSED')")
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                        str(Path(AGENTCELL).parent / "python"), "-c", code,
                        str(runtime_dir / "agentcell" / "launcher.sock")], capture_output=True, text=True)
    assert p.stdout.strip() == "REFUSED", p.stdout + p.stderr


def test_client_ignores_a_launcher_directory_others_can_write(user: User, runtime_dir: Path) -> None:
    warm(user, runtime_dir, "start")
    os.chmod(runtime_dir / "agentcell", 0o777)
    r = agentcell_run(["--", "true"], as_user=user, env={"XDG_RUNTIME_DIR": str(runtime_dir)}, warm=True)
    assert r.rc == 0 and r.result["via"] == "here"
    os.chmod(runtime_dir / "agentcell", 0o700)


def test_idle_launcher_exits_by_itself(user: User, runtime_dir: Path) -> None:
    assert warm(user, runtime_dir, "start", "--idle", "0.3").returncode == 0
    for _ in range(200):
        if warm(user, runtime_dir, "status").returncode == 1:
            break
        time.sleep(0.05)
    assert warm(user, runtime_dir, "status").returncode == 1
    assert not (runtime_dir / "agentcell" / "launcher.sock").exists()


def test_warm_bad_flag_is_one_line() -> None:
    p = subprocess.run([AGENTCELL, "warm", "start", "--idle", "-3"], capture_output=True, text=True)
    assert p.returncode == 125 and len(p.stderr.strip().splitlines()) == 1 and "--idle" in p.stderr


CELL_CLIENT = """
import _socket, marshal, sys
s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
try:
    s.connect(sys.argv[1])
    s.sendmsg([marshal.dumps({"op": "status"})])
    data = s.recv(65536)
    print("ANSWERED" if data else "REFUSED")
except OSError as e:
    print("REFUSED", e.errno)
"""


def test_a_rootless_cell_cannot_order_cells_from_its_owners_launcher(user: User, runtime_dir: Path) -> None:
    warm(user, runtime_dir, "start")
    # The socket reaches the cell under another name (a bind mount, so no mask covers it): the
    # launcher itself must refuse a peer inside a cell, though it has the launcher's uid.
    exposed = Path(f"/tmp/agentcell-exposed-{os.getpid()}")
    exposed.mkdir()
    subprocess.run(["mount", "--bind", str(runtime_dir / "agentcell"), str(exposed)], check=True)
    try:
        r = agentcell_run(["--ro", str(exposed), "--", "python3", "-c", CELL_CLIENT,
                           str(exposed / "launcher.sock")], as_user=user, env={"XDG_RUNTIME_DIR": str(runtime_dir)})
    finally:
        subprocess.run(["umount", str(exposed)], check=True)
        exposed.rmdir()
    assert r.out.startswith("REFUSED"), r.out + r.err
    # The same client outside any cell is answered: the refusal above is about the cell.
    p = subprocess.run([*user.prefix(), str(Path(AGENTCELL).parent / "python"), "-c", CELL_CLIENT,
                        str(runtime_dir / "agentcell" / "launcher.sock")], capture_output=True, text=True)
    assert p.stdout.startswith("ANSWERED"), p.stdout + p.stderr


def test_launcher_directory_is_masked_in_cells_that_share_its_parent(user: User, runtime_dir: Path) -> None:
    warm(user, runtime_dir, "start")
    r = agentcell_run(["--ro", str(runtime_dir), "--", "ls", "-A", str(runtime_dir / "agentcell")],
                      as_user=user, env={"XDG_RUNTIME_DIR": str(runtime_dir)})
    assert r.rc != 0 or r.out.strip() == "", r.out
    assert "launcher.sock" not in r.out


def test_launcher_directories_are_masked_whatever_the_callers_environment(user: User) -> None:
    # The launcher listens in the usual /run/user/UID; the cell's caller has no XDG_RUNTIME_DIR but
    # shares that directory (runtime state: refused unless the caller insists, as here). (Unusual
    # XDG_RUNTIME_DIRs are not known to a caller without the variable:
    # there the launcher's namespace check is what refuses a cell, see above.)
    rt = Path(f"/run/user/{user.uid}")
    made_parent = not rt.parent.exists()
    rt.mkdir(parents=True, mode=0o700)
    shutil.chown(rt, user.uid, user.gid)
    try:
        warm(user, rt, "start")
        r = agentcell_run(["--rw", str(rt), "--allow-unsafe-path", "--", "ls", "-A", str(rt / "agentcell")],
                          as_user=user)
        assert r.rc in (0, 2) and "launcher.sock" not in r.out, r.out + r.err
    finally:
        stop_launcher(user, rt)
        shutil.rmtree(rt, ignore_errors=True)
        if made_parent:
            rt.parent.rmdir()


def test_root_run_leaves_its_runtime_dir_private_so_warm_start_works(user: User) -> None:
    """/run/agentcell as an older release left it (0755, made as the parent of the first record): a root
    'agentcell run' tightens it, and 'agentcell warm start' then runs (it refused before)."""
    run_dir = Path("/run/agentcell")
    run_dir.mkdir(exist_ok=True)
    os.chmod(run_dir, 0o755)
    assert agentcell_run(["--as", str(user.uid), "--", "true"]).rc == 0
    assert run_dir.stat().st_mode & 0o777 == 0o700
    try:
        p = subprocess.run([AGENTCELL, "warm", "start"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        r = agentcell_run(["--as", str(user.uid), "--", "true"], warm=True)
        assert r.rc == 0 and r.result["via"] == "warm launcher"
    finally:
        pid = subprocess.run([AGENTCELL, "warm", "status"], capture_output=True, text=True).stdout
        subprocess.run([AGENTCELL, "warm", "stop"], capture_output=True)
        for word in pid.replace(",", " ").split():
            if word.isdigit() and _is_launcher(int(word)):
                os.kill(int(word), signal.SIGKILL)


# ---- the compiled front (front/agentcell.c; host/clihost.py) ------------------------------------------


def served_by_front(user: User, rt: Path) -> int:
    return int(launcher_status(user, rt)["fronts_served"])


def test_the_compiled_front_hands_run_to_the_launcher_which_runs_the_cli_as_the_caller(
        user: User, runtime_dir: Path, project: Path) -> None:
    """`agentcell` is the compiled front. With a launcher running, `run` is served by a process the
    launcher forks that takes on the caller's argv, environment, working directory and stdio, and runs
    the Python CLI's code: what comes out, what is written where and the status are the same as with the
    front switched off (AGENTCELL_FRONT=off: the Python CLI, which hands its cell to the same launcher)."""
    assert Path(AGENTCELL).read_bytes()[:4] == b"\x7fELF", "scripts/setup.sh builds the front"
    warm(user, runtime_dir, "start")
    script = ('echo "value=$AGENTCELL_TEST_VALUE"; pwd; id -u; echo "$1" > "made-$1"; echo to-stderr >&2; '
              'cat; exit 3')
    outs = []
    for front in ("on", "off"):
        before = served_by_front(user, runtime_dir)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": str(runtime_dir),
               "AGENTCELL_TEST_VALUE": "from the caller", "AGENTCELL_FRONT": front}
        p = subprocess.run([*user.prefix(), AGENTCELL, "run", "--rw", ".", "--keep-env", "AGENTCELL_TEST_VALUE",
                            "--json", "--", "sh", "-c", script, "sh", front], cwd=project, env=env, input="stdin\n",
                           capture_output=True, text=True, timeout=60)
        *lines, last = p.stdout.splitlines()
        result = json.loads(last)
        assert p.returncode == 3 and result["via"] == "warm launcher", (p.returncode, p.stderr)
        assert lines == ["value=from the caller", str(project), str(user.uid), "stdin"], p.stdout
        assert p.stderr == "to-stderr\n"
        assert (project / f"made-{front}").read_text() == f"{front}\n"
        assert served_by_front(user, runtime_dir) == before + (front == "on")
        outs.append((lines, p.stderr, p.returncode))
    assert outs[0] == outs[1]
    # Once a front has come, the launcher keeps the next front's CLI process forked ahead; a run takes it.
    for _ in range(200):
        ahead = launcher_status(user, runtime_dir)["cli_ahead"]
        if ahead:
            break
        time.sleep(0.05)
    assert ahead and Path(f"/proc/{ahead}").exists()
    p = subprocess.run([*user.prefix(), AGENTCELL, "run", "--", "sh", "-c", "echo ahead; exit 5"], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime_dir)}, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (5, "ahead\n", "")
    for _ in range(200):  # used once: it served that run and is gone
        if not Path(f"/proc/{ahead}").exists():
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{ahead}").exists()
    # A bad flag: the CLI's own one line and status, from the launcher's process as from Python.
    p = subprocess.run([*user.prefix(), AGENTCELL, "run", "--memory", "lots", "--", "true"], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime_dir)})
    assert p.returncode == 125 and len(p.stderr.splitlines()) == 1 and "--memory" in p.stderr, p.stderr


def test_a_caller_that_may_do_less_than_the_launcher_is_refused_and_runs_the_cli_itself(
        user: User, runtime_dir: Path) -> None:
    """A process forked by the launcher has the launcher's powers: a caller with fewer (here
    no_new_privs) is refused at the door (the front, and the Python CLI after it), and runs cold."""
    warm(user, runtime_dir, "start")
    before = served_by_front(user, runtime_dir)
    p = subprocess.run([*user.prefix(), "setpriv", "--no-new-privs", AGENTCELL, "run", "--json", "--", "sh", "-c",
                        "grep NoNewPrivs /proc/self/status"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime_dir)}, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1])["via"] == "here"
    assert served_by_front(user, runtime_dir) == before


def test_the_front_hands_nothing_to_a_launcher_of_another_uid(user: User, runtime_dir: Path) -> None:
    """A listener of another uid (root here) where the caller's launcher would be: the front checks its
    peer's uid, sends nothing, and the run is built by the Python CLI."""
    nothing_reaches_an_impostor(user, runtime_dir, [str(Path(AGENTCELL).parent / "python")], [])


def test_the_front_hands_nothing_to_a_weaker_process_of_the_callers_in_the_launchers_place(
        user: User, runtime_dir: Path) -> None:
    """A process of the caller's own uid, but with less (here no_new_privs, as any Landlock sandbox has),
    listens where the launcher would: it must not get the caller's environment and stdio, nor forge a run's
    result. The front and the Python CLI both check it, and build the cell themselves."""
    nothing_reaches_an_impostor(user, runtime_dir, [*user.prefix(), "setpriv", "--no-new-privs", "python3"], [])


def test_a_caller_in_a_network_namespace_of_its_own_is_refused_and_runs_cold(user: User, runtime_dir: Path) -> None:
    """A caller kept off the network by a namespace of its own must not reach the host's network through
    the launcher (whose cells and proxy live in the host's): it is refused, and its run is built in its
    own namespace."""
    warm(user, runtime_dir, "start")
    before = served_by_front(user, runtime_dir)
    p = subprocess.run(["unshare", "--net", "setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups",
                        "--", AGENTCELL, "run", "--json", "--", "true"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime_dir)})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1])["via"] == "here"
    assert served_by_front(user, runtime_dir) == before


# ---- a session start handed to the launcher's session starter (host/starter.py) ---------------------


def _session_front(user: User, rt: Path, home: Path, project: Path, front: str, script: str,
                   ) -> subprocess.Popen[str]:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": str(rt),
           "AGENTCELL_FRONT": front}
    return subprocess.Popen([*user.prefix(), AGENTCELL, "session", "start", "--ceilings", "off", "--harness", "shell",
                             "--project", str(project), "--json", "--", "sh", "-c", script], cwd=project, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_session_start_is_forked_from_the_launchers_session_starter_and_is_the_same_session(
        user: User, runtime_dir: Path, project: Path) -> None:
    """With a launcher running, the front hands `session start` over: the launcher's session starter (a
    child of the launcher that has the session's modules imported) forks a process that becomes the
    caller's CLI. The session's output, status, summary and trail are those of a Python `session start`
    (AGENTCELL_FRONT=off); a second session is forked from the same starter; a SIGTERM to the front
    reaches the session, which tears itself down and says so."""
    home = Path(f"/home/{user.name}")
    home.mkdir(mode=0o700)
    shutil.chown(home, user.uid, user.gid)
    try:
        warm(user, runtime_dir, "start")
        launcher = int(launcher_status(user, runtime_dir)["pid"])
        outs, starters = [], []
        for front in ("on", "off", "on"):
            before = served_by_front(user, runtime_dir)
            p = _session_front(user, runtime_dir, home, project, front, 'echo "in $(pwd) as $(id -u)"; exit 3')
            out, err = p.communicate(timeout=120)
            *lines, last = out.splitlines()
            summary = json.loads(last)
            assert p.returncode == 3 and summary["status"] == "completed", (p.returncode, err)
            assert "Traceback" not in err
            outs.append((lines, p.returncode, summary["exit_status"], summary["os_user"]))
            assert served_by_front(user, runtime_dir) == before + (front == "on")
            if front == "on":
                status = launcher_status(user, runtime_dir)
                starters.append(int(status["session_starter"]))
                assert proc_ppid(starters[-1]) == launcher
        assert outs[0] == outs[1] == outs[2] == ([f"in {project} as {user.uid}"], 3, 3, user.name), outs
        assert starters[0] == starters[1], "one starter forks every session"
        trail = [json.loads(line) for line in
                 (home / ".local/state/agentcell/audit/audit.jsonl").read_text().splitlines()]
        assert [r["event"] for r in trail].count("session.end") == 3
        # A session running in the cell, its front told to stop: the session's SIGTERM, its teardown.
        p = _session_front(user, runtime_dir, home, project, "on", "echo up; exec sleep 60")
        assert p.stdout is not None
        assert p.stdout.readline() == "up\n"
        session_pid = next(int(x) for x in os.listdir("/proc") if x.isdigit() and _is_child_of(int(x), starters[0]))
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
        summary = json.loads(out.splitlines()[-1])
        assert p.returncode == 120 and summary["status"] == "terminated", (p.returncode, err)
        assert summary["reason"] == "stopped: signal 15", summary
        for _ in range(200):  # (the front has its status from the session itself, before it is reaped)
            if not _is_child_of(session_pid, starters[0]):
                break
            time.sleep(0.05)
        assert not _is_child_of(session_pid, starters[0])
        # A front killed outright (no signal to forward): its session is told to end, and ends whole.
        p = _session_front(user, runtime_dir, home, project, "on", "echo up; exec sleep 60")
        assert p.stdout is not None and p.stdout.readline() == "up\n"
        p.kill()
        p.wait(timeout=30)
        trail_file = home / ".local/state/agentcell/audit/audit.jsonl"
        for _ in range(400):
            trail = [json.loads(line) for line in trail_file.read_text().splitlines()]
            if trail[-1]["event"] == "session.end":
                break
            time.sleep(0.05)
        assert trail[-1]["event"] == "session.end" and trail[-1]["details"]["status"] == "terminated", trail[-1]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _is_child_of(pid: int, parent: int) -> bool:
    return proc_ppid(pid) == parent


def _holders() -> list[int]:
    try:
        return [int(h["pid"]) for h in json.loads(Path("/run/agentcell/calls.json").read_text())["holders"]]
    except (OSError, ValueError, KeyError):
        return []


def test_roots_launcher_holds_the_monitors_programs_that_each_watched_cell_joins(user: User) -> None:
    """Root's warm launcher holds the monitor's host programs once a watched cell has come (each cell's
    monitor then joins them, copies of their fds, instead of loading and attaching them: about 15 ms of
    every watched cell), and lets them go as it stops. The cells it serves are watched as before: a read
    of /etc/shadow ends the cell."""
    p = subprocess.run([AGENTCELL, "warm", "start"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    launcher = int(p.stdout.split(" pid ")[1].split(",")[0])
    try:
        assert launcher not in _holders()
        r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "true"], warm=True)
        assert r.rc == 0 and r.result["via"] == "warm launcher", r.err
        assert launcher in _holders(), "the launcher holds them after a watched cell"
        r = agentcell_run(["--as", str(user.uid), "--monitor", "--", "cat", "/etc/shadow"], warm=True)
        assert r.rc == 137 and r.result["terminated_by_monitor"], (r.rc, r.err)
        assert any(e["target"] == "/etc/shadow" for e in r.result["events"]), r.result["events"]
        assert launcher in _holders()
    finally:
        subprocess.run([AGENTCELL, "warm", "stop"], capture_output=True, timeout=60)
        if _is_launcher(launcher):
            os.kill(launcher, signal.SIGKILL)
    assert launcher not in _holders(), "let go as it stopped"


def test_a_sigterm_to_a_cell_host_the_launcher_forked_takes_its_cell_down(user: User) -> None:
    """A host the launcher forked for a supervised cell stops as a cold one does on SIGTERM (an operator's
    kill, a service manager's stop): its cell killed, its cgroup and firewall table removed, the client
    told the cell ended, and the command never run a second time (red team: the host died of the signal's
    default and left the cell's cgroup; a client that lost its host before the "started" reply ran the
    command again, through the launcher's next host, though it had run)."""
    p = subprocess.run([AGENTCELL, "warm", "start"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    launcher = int(p.stdout.split(" pid ")[1].split(",")[0])
    tag = f"{secrets.randbelow(10**6)}.9"
    argv = [b"sleep", tag.encode()]
    run = subprocess.Popen([AGENTCELL, "run", "--json", "--as", str(user.uid), "--monitor", "--net", "proxy", "--",
                            "sh", "-c", f"echo up; exec sleep {tag}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    try:
        assert run.stdout is not None and run.stdout.readline() == "up\n", run.stderr
        for _ in range(200):
            if processes_with_argv(argv):
                break
            time.sleep(0.05)
        [sleeper] = processes_with_argv(argv)
        cgroup = "/sys/fs/cgroup" + Path(f"/proc/{sleeper}/cgroup").read_text().split("::", 1)[1].strip()
        host = proc_ppid(proc_ppid(sleeper))  # the cell's PID 1, then who made it
        assert proc_ppid(host) == launcher and b"zygote" in Path(f"/proc/{host}/cmdline").read_bytes()
        os.kill(host, signal.SIGTERM)
        out, err = run.communicate(timeout=60)
        for _ in range(200):
            if not processes_with_argv(argv) and not Path(cgroup).exists():
                break
            time.sleep(0.05)
        assert not processes_with_argv(argv) and "up" not in out.splitlines(), (out, err[-300:])  # (once: above)
        assert not Path(cgroup).exists(), f"{cgroup} left behind"
        result = json.loads(out.strip().splitlines()[-1])
        assert run.returncode != 0 and result["via"] == "warm launcher", (run.returncode, result)
        # stopped once the host had reported the start (its reason), or before (lost: never run again)
        assert "its host was stopped (signal 15)" in err or "went away while the command ran" in err, err[-300:]
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        assert result["cell_id"] and result["cell_id"] not in tables, tables
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        subprocess.run([AGENTCELL, "warm", "stop"], capture_output=True, timeout=60)
        if _is_launcher(launcher):
            os.kill(launcher, signal.SIGKILL)


@pytest.mark.parametrize("then", ["nothing", "going, then gone", "going, then an error"])
def test_a_client_that_loses_its_host_after_going_never_runs_the_command_again(then: str) -> None:
    """The client's side of 'going' (a host speaking the protocol from a thread): lost before it, the
    host is unavailable (nothing ran: the caller may start the command elsewhere); after it, the command
    is lost, or its error is its end (a session ends terminated, saying the host ended it, and its cleanup
    still looks at what it planted), never an error its caller would start it again after."""
    import _socket
    import threading

    from agentcell.host import wire
    from agentcell.host.remote import HostUnavailable, RemoteCell

    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)

    def host() -> None:
        msg, _ = wire.recv_or_gone(theirs)
        assert msg == {"op": "run"}
        if then != "nothing":
            wire.send(theirs, {"event": "going", "cell_id": "agentcell-test"})
        if then.endswith("an error"):
            wire.send(theirs, {"event": "error", "field": "--net", "message": "the proxy did not start",
                               "code": 123})
        theirs.close()

    t = threading.Thread(target=host)
    t.start()
    cell = RemoteCell(ours, None, supervised=True)
    try:
        if then == "nothing":
            with pytest.raises(HostUnavailable):
                cell._begin({"op": "run"}, [])
        elif then.endswith("an error"):  # its end, as the host said it: never an error to start it again after
            cell._begin({"op": "run"}, [])
            result = cell.wait()
            assert (result["exit_status"], result["host_ended"], result["cell_id"]) == (123, True, "agentcell-test")
            assert "the proxy did not start" in result["error"] and not cell.was_lost, result
        else:
            cell._begin({"op": "run"}, [])
            result = cell.wait()
            assert cell.was_lost and result["exit_status"] is None and cell.cell_id == "agentcell-test", result
    finally:
        t.join()
        cell.close()
