"""A developer's working day in a session (issue 26), with the real harness CLIs: each one, driven by the
scripted model endpoint (agentcell.harness.mockmodel, a mock of the model API: the one part that cannot
exist here) on a fake internet of the test's own (a mock of the internet), reads the repository's history,
fixes a bug, runs the project's test, commits, makes a branch, installs a package through the pypi preset
(pypi.org there is a registry stand-in of the test's, over HTTPS with a test CA) and pushes the branch to an
HTTPS remote with a token the proxy injects (the cell holds a placeholder). Then the human, on the host,
sees the agent's commit with their own git and works on.

Each harness does that day as a per-session account, as a persistent agent (``--agent``) and without root
(an ordinary user's session, ``--ceilings off``).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentcell.harness.check import Rig
from agentcell.harness.profiles import PROFILES
from conftest import AGENTCELL, User, needs_root
from harnesses import Unavailable, bin_dir, session_env
from sessionkit import Env, account_gone, session, session_environ
from sessionkit import agent as agent  # noqa: F401 - the fixture, under its own name
from sessionkit import env as env  # the fixture, under its own name
from test_benign import PKG, _certificates, _registries
from test_git import EMAIL, NAME, as_human
from test_git import repo as repo  # noqa: F401 - the fixture, under its own name

pytestmark = needs_root

HERE = Path(__file__).parent
HARNESSES = ("claude_code", "codex", "opencode", "gemini", "aider")
KEYS = {"ANTHROPIC_API_KEY": "sk-ant-test-key", "OPENAI_API_KEY": "sk-openai-test-key", "GEMINI_API_KEY": "gm-test"}
TOKEN = "ghp_" + secrets.token_hex(18)  # the remote's token: the cell must only ever hold a placeholder
HELPER = "!f() { echo username=x-access-token; echo password=$GH_TOKEN; }; f"


class Day:
    """The fake internet of the day: the model endpoint, git.test (HTTPS git that wants the token) and
    pypi.org (the registry stand-in); the test CA both are signed by, in a file the cell can read."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.rig = Rig(str(work), hosts={"git.test": 90, "pypi.org": 93})
        _certificates(work, "git.test", "pypi.org")
        _registries(work)
        self.remotes = work / "repos"
        self.remotes.mkdir()
        subprocess.run(["chmod", "-R", "a+rX", str(work)], check=True)
        mirror = [sys.executable, str(HERE / "mirror.py")]
        leaf = [str(work / "leaf.pem"), str(work / "leaf.key")]
        self.rig.net.start([*mirror, self.rig.hosts["git.test"], "443", "git", str(self.remotes), *leaf, TOKEN],
                           ready=b"ready", as_nobody=False)  # it writes what is pushed
        self.rig.net.start([*mirror, self.rig.hosts["pypi.org"], "443", "files", str(work / "pypi"), *leaf],
                           ready=b"ready")

    def remote(self) -> Path:
        """A new bare repository on git.test that takes pushes."""
        bare = self.remotes / f"r{secrets.token_hex(3)}.git"
        subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
        subprocess.run(["git", "-C", str(bare), "config", "http.receivepack", "true"], check=True)
        return bare

    def flags(self, ca: Path) -> list[str]:
        return [*self.rig.flags(), "--allow-domain", "git.test:443", "--allow-preset", "pypi",
                "--secret", "GH_TOKEN", "--secret-host", "GH_TOKEN=git.test:authorization",
                "--upstream-ca", str(ca)]  # the gateway's CA, as the way out is signed: the cell trusts it too


@pytest.fixture(scope="module")
def day() -> Iterator[Day]:
    work = Path(tempfile.mkdtemp(prefix="agentcell-workday-"))  # its servers run as nobody: not under 0700 dirs
    os.chmod(work, 0o755)
    d = None
    try:
        d = Day(work)
        yield d
    finally:
        if d is not None:
            d.rig.close()
            assert d.rig.net.leftovers() == []
        shutil.rmtree(work, ignore_errors=True)


def steps(pip: Path, remote: str) -> list[dict[str, str]]:
    """(Files are named by globs: aider takes a path in an answer for a file to add to its chat, and a reply
    that adds one runs none of its commands.)"""
    return [{"shell": "git log --oneline"},
            {"shell": "sed -i 's/a-b/a+b/' src/calc*.py && python3 src/test_c*.py && echo TESTS-OK"},
            {"shell": "git add -u && git commit -qm 'fix add()' && git checkout -q -b feature && "
                      "git log -1 --format='%an|%s'"},
            {"shell": f"{pip} install -q --disable-pip-version-check --target lib {PKG} && "
                      "PYTHONPATH=lib python3 -c 'import agentcell_probe_pkg as p; print(p.WHERE)'"},
            {"shell": f"git -c credential.helper='{HELPER}' push -q {remote} feature 2>&1; echo pushed=$?"},
            {"text": "The bug is fixed on branch feature, tested, and pushed."}]


def installed(name: str) -> Path:
    try:
        return bin_dir(name)
    except Unavailable as e:
        pytest.skip(str(e))


def start(day: Day, name: str, project: Path, ca: Path, remote: Path, args: list[str], *,
          run: Any) -> dict[str, Any]:
    """One day's session of ``name`` (``run``: how the session is started, as root or as the user);
    what the endpoint saw of it is returned with the summary."""
    pip = installed("pytest") / "pip"  # a venv of the system's Python under /opt, which the cell sees
    day.rig.serve(steps(pip, f"https://git.test/{remote.name}"), fenced=PROFILES[name].fenced)
    bindir = installed(name)
    summary = run(["start", "--harness", name, "--project", str(project), *day.flags(ca), *session_env(name),
                   "--json", *args, "--", "Fix the failing test, commit on a branch, push it."],
                  {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", **KEYS, "GH_TOKEN": TOKEN})
    return {"summary": summary, "requests": day.rig.requests()}


def check_day(day: Day, name: str, seen: dict[str, Any], project: Path, remote: Path, user: User, home: Path,
              agent_name: str) -> None:
    summary = seen["summary"]
    assert summary.get("status") == "completed", summary
    assert summary.get("escape") is None, summary
    assert summary["warnings"] == [] and summary["problems"] == [], summary
    results = "\n".join(res for r in seen["requests"] if r["kind"] == "main" for res in r["results"])
    if not PROFILES[name].fenced:  # aider's one turn runs the commands; their output would go with a next one
        for what in ("initial", "TESTS-OK", f"{NAME} (agent: {agent_name})|fix add()", "from the mirror",
                     "pushed=0"):
            assert what in results, (what, results[-3000:])
        assert "dubious ownership" not in results and TOKEN not in results
    # the host: the fix, the package, the pushed branch with the agent's commit, the human's git after
    assert "a+b" in (project / "src" / "calc.py").read_text(), summary.get("output")
    assert (project / "lib" / "agentcell_probe_pkg" / "__init__.py").exists()
    pushed = subprocess.run(["git", "-C", str(remote), "log", "--format=%an|%s", "feature"], capture_output=True,
                            text=True)
    assert pushed.returncode == 0 and pushed.stdout.splitlines()[0] == f"{NAME} (agent: {agent_name})|fix add()", \
        pushed
    log = as_human(user, home, "git", "log", "--all", "--format=%an <%ae>|%s", cwd=project)
    assert f"{NAME} (agent: {agent_name}) <{EMAIL}>|fix add()" in log.stdout.splitlines(), log
    for argv in (["git", "status", "--short"], ["git", "checkout", "-q", "main"], ["git", "merge", "-q", "feature"],
                 ["git", "commit", "-q", "--allow-empty", "-m", "mine"], ["git", "gc", "-q"],
                 ["git", "fsck", "--no-progress"]):
        p = as_human(user, home, *argv, cwd=project)
        assert p.returncode == 0, (argv, p.stdout, p.stderr)


def _ignore_lib(project: Path, user: User) -> None:
    (project / ".gitignore").write_text("lib/\n")
    shutil.chown(project / ".gitignore", user.uid, user.gid)


def as_root(env: Env) -> Any:
    def run(args: list[str], extra: dict[str, str]) -> dict[str, Any]:
        s = session(env, args, extra=extra, timeout=300)
        return {**s.summary, "output": (s.out + s.err)[-4000:]}
    return run


@pytest.mark.parametrize("name", HARNESSES)
def test_a_day_as_a_per_session_account(name: str, day: Day, env: Env, user: User,
                                        repo: tuple[Path, Path]) -> None:
    project, home = repo
    _ignore_lib(project, user)
    remote = day.remote()
    seen = start(day, name, project, day.work / "ca.pem", remote, [], run=as_root(env))
    check_day(day, name, seen, project, remote, user, home, name)
    assert account_gone(seen["summary"]["os_user"])


@pytest.mark.parametrize("name", HARNESSES)
def test_a_day_as_a_persistent_agent(name: str, day: Day, env: Env, user: User, repo: tuple[Path, Path],
                                     agent: str) -> None:
    project, home = repo
    _ignore_lib(project, user)
    remote = day.remote()
    seen = start(day, name, project, day.work / "ca.pem", remote, ["--agent", agent, "--rw", str(project)],
                 run=as_root(env))
    check_day(day, name, seen, project, remote, user, home, name)


@pytest.mark.parametrize("name", HARNESSES)
def test_a_day_without_root(name: str, day: Day, env: Env, user: User, repo: tuple[Path, Path]) -> None:
    """The user's own session: the agent runs as them, the state is in their home's XDG state."""
    project, home = repo
    _ignore_lib(project, user)
    remote = day.remote()

    def run(args: list[str], extra: dict[str, str]) -> dict[str, Any]:
        p = subprocess.run([*user.prefix(), "env", "-i", f"HOME={home}", "LANG=C.UTF-8",
                            *(f"{k}={v}" for k, v in extra.items()), AGENTCELL, "session", *args[:1],
                            "--ceilings", "off", *args[1:]], capture_output=True, text=True, timeout=300,
                           cwd=project, stdin=subprocess.DEVNULL)
        lines = p.stdout.strip().splitlines()
        assert "Traceback" not in p.stderr, p.stderr
        return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {"stderr": p.stderr[-3000:]}

    seen = start(day, name, project, day.work / "ca.pem", remote, [], run=run)
    check_day(day, name, seen, project, remote, user, home, name)
    assert seen["summary"]["os_user"] == user.name


def test_claude_codes_tui_in_tmux_does_the_day_and_ctrl_c_gives_the_terminal_back(
        day: Day, env: Env, user: User, repo: tuple[Path, Path]) -> None:
    """A person's terminal: tmux (its own server, a shell in a 120x40 window) runs the session; the prompt
    is typed into Claude Code's TUI, which does the day's work; two Ctrl-C end it, the session ends clean
    (its summary in the pane), and the shell gets the terminal back as it was (not on the alternate
    screen, canonical mode and echo on)."""
    import time

    project, home = repo
    _ignore_lib(project, user)
    remote = day.remote()
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (test.sh installs it)")
    bindir = installed("claude_code")
    pip = installed("pytest") / "pip"
    day.rig.serve(steps(pip, f"https://git.test/{remote.name}"))
    sock = env.state / "tmux.sock"
    environ = {**{k: v for k, v in session_environ(env).items() if k != "PATH"},
               "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", **KEYS, "GH_TOKEN": TOKEN, "HOME": "/root",
               "PS1": "$ "}

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-S", str(sock), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    def pane() -> str:
        return tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "day")

    def until(needle: str, limit_s: float = 90) -> str:
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            shown = pane()
            if needle in shown:
                return shown
            time.sleep(0.3)
        raise AssertionError(f"{needle!r} never showed:\n{pane()}")

    subprocess.run(["tmux", "-S", str(sock), "-f", "/dev/null", "new-session", "-d", "-s", "day", "-x", "120",
                    "-y", "40", "-c", str(project), "env", "-i", *(f"{k}={v}" for k, v in environ.items()),
                    "sh"], check=True, timeout=30)
    try:
        tmux("set-option", "-t", "day", "history-limit", "20000")
        command = " ".join([AGENTCELL, "session", "start", "--harness", "claude_code", "--project", str(project),
                            *day.flags(day.work / "ca.pem"), "--json"])
        tmux("send-keys", "-t", "day", "-l", command)
        tmux("send-keys", "-t", "day", "Enter")
        until("bypass permissions on")
        tmux("send-keys", "-t", "day", "-l", "Fix the failing test, commit on a branch, push it.")
        until("push it.")  # typed, as a person types: then Enter (one sent with the text is taken as pasted)
        time.sleep(1)
        tmux("send-keys", "-t", "day", "Enter")
        until("pushed.")  # its closing words: the day's shell steps ran before them
        tmux("send-keys", "-t", "day", "C-c")
        time.sleep(0.2)
        tmux("send-keys", "-t", "day", "C-c")  # twice within 800 ms: Claude Code's own way out
        shown = until('"status": "completed"')
        summary = json.loads(next(line for line in reversed(shown.splitlines()) if line.startswith('{"session"')))
        assert summary["exit_status"] == 0 and summary["problems"] == [] and summary["warnings"] == [], summary
        assert account_gone(summary["os_user"])
        tmux("send-keys", "-t", "day", "-l", "stty -a | tr ';' '\\n' | grep -wE -- '-?icanon|-?echo'; echo END")
        tmux("send-keys", "-t", "day", "Enter")
        after = until("\nEND")
        assert tmux("display-message", "-p", "-t", "day", "#{alternate_on}").strip() == "0"
        modes = after.rsplit("stty -a", 1)[1].split()
        assert "icanon" in modes and "echo" in modes and "-icanon" not in modes and "-echo" not in modes, modes
    finally:
        def ended() -> bool:
            try:
                return '"status": ' in pane()
            except subprocess.CalledProcessError:  # (no server: nothing runs in it)
                return True

        if not ended():  # the session still runs (a failure above): end it as a person would,
            for _ in range(2):            # and let it clean up before its terminal goes
                subprocess.run(["tmux", "-S", str(sock), "send-keys", "-t", "day", "C-c"], capture_output=True)
                time.sleep(0.2)
            end = time.monotonic() + 60
            while not ended() and time.monotonic() < end:
                time.sleep(0.5)
        subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True, timeout=30)
    seen = {"summary": {**summary, "escape": None}, "requests": day.rig.requests()}
    check_day(day, "claude_code", seen, project, remote, user, home, "claude_code")
