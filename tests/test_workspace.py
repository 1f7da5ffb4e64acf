"""Copy-on-write workspaces (issue 27, :mod:`agentcell.workspace`): several sessions at once on one
project, each in its own view whose writes land in its change set; the human's tree and ``.git`` are not
written until ``session apply``, which lands a session's work on the tree as it is then, refuses what
the human changed too, and brings the agent's commits as a branch.

Every session here is real: the CLI as root (a per-session account each) or as the throwaway user
(rootless), the real overlayfs and idmapped mounts, the real git as the human afterwards.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import AGENTCELL, User, needs_root
from sessionkit import Env, account_gone, records, session, session_environ
from sessionkit import env as env  # noqa: F401 - the fixture, under its own name

pytestmark = needs_root


def as_user(user: User, *argv: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*user.prefix(), "env", "-i", "PATH=/usr/bin:/bin", "HOME=/nonexistent", "LANG=C.UTF-8",
                           *argv], cwd=cwd, capture_output=True, text=True, check=check, timeout=120)


def git(user: User, project: Path, *args: str) -> str:
    return as_user(user, "git", "-c", "user.name=Human", "-c", "user.email=human@example.test", *args,
                   cwd=project).stdout


def write(user: User, path: Path, text: str) -> None:
    as_user(user, "sh", "-c", 'mkdir -p "$(dirname "$1")" && printf %s "$2" > "$1"', "sh", str(path), text,
            cwd=path.parent if path.parent.exists() else Path("/"))


def digest(top: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[int, str]]:
    """Every entry below ``top`` (.git included): its mode and its bytes (or a link's target)."""
    out: dict[str, tuple[int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(top))
            if rel in skip:
                continue
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = (st.st_mode, os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = (st.st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[rel] = (st.st_mode, "")
    return out


@dataclass
class UserEnv(Env):
    """A rootless user's sessions on the same project: the CLI run as them, their XDG state."""
    prefix: list[str] = field(default_factory=list)
    home: Path = Path("/nonexistent")

    @property
    def audit(self) -> Path:
        return self.state / "audit" / "audit.jsonl"


def _how(env: Env) -> tuple[list[str], dict[str, str] | None, list[str]]:
    """(argv prefix, environment, flags) the CLI runs with for ``env``."""
    if isinstance(env, UserEnv):
        return ([*env.prefix, "env", "-i", f"HOME={env.home}", "PATH=/usr/bin:/bin", "LANG=C.UTF-8"], None,
                ["--ceilings", "off"])
    return [], session_environ(env), []


def cli(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    prefix, environ, _ = _how(env)
    p = subprocess.run([*prefix, AGENTCELL, "session", *args], capture_output=True, text=True, env=environ,
                       cwd=env.project, timeout=300, stdin=subprocess.DEVNULL)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def review(env: Env, sid: str) -> dict[str, Any]:
    p = cli(env, "review", sid, "--json", "--diff")
    assert p.returncode == 0, p.stderr
    r: dict[str, Any] = json.loads(p.stdout)
    return r


def changes(r: dict[str, Any]) -> set[tuple[str, ...]]:
    return {(c["change"], c["path"], *([c["from"]] if "from" in c else [])) for c in r["changes"]}


def upper(env: Env, sid: str) -> Path:
    return env.state / "workspaces" / sid / "cs" / "upper"


BARRIER = 'run sh -c "while [ -z \\"$(ls -A barrier)\\" ]; do sleep 0.05; done"'


def start_waiting(env: Env, sid: str, steps: str, *flags: str, harness: str = "scripted") -> subprocess.Popen[str]:
    """A --workspace copy session whose agent does ``steps``, says it is ready (a file in its own change
    set) and waits until the project's ``barrier/`` holds something. (It lists the directory: overlayfs
    keeps a name looked up before the lower layer had it as absent, while a directory only the lower
    layer has is read from it each time. The human's changes to the project while a view is mounted are
    not the view's to follow: overlayfs leaves that undefined; the base is what the session started from.)
    ``harness`` shell: ``steps`` is a shell script."""
    if harness == "scripted":
        script = steps_file(sid)
        script.write_text(f"{steps}\nwrite ready yes\n{BARRIER}\nrun rm ready\n")
        argv = [str(script)]
    else:
        argv = ["sh", "-c", f"set -e; {steps}; : > ready; while [ -z \"$(ls -A barrier)\" ]; do sleep 0.05; done; "
                "rm ready"]
    prefix, environ, more = _how(env)
    return subprocess.Popen([*prefix, AGENTCELL, "session", "start", "--workspace", "copy", "--harness", harness,
                             "--id", sid, "--json", *more, *flags, "--", *argv], env=environ, cwd=env.project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def steps_file(sid: str) -> Path:
    """The scripted agent's steps: where a rootless user can read them too (removed by :func:`finish`)."""
    return Path("/tmp") / f"agentcell-test-steps-{sid}.txt"


def wait_ready(env: Env, procs: dict[str, subprocess.Popen[str]]) -> None:
    for _ in range(2400):
        if all((upper(env, sid) / "ready").exists() for sid in procs):
            return
        done = {sid: p for sid, p in procs.items() if p.poll() is not None}
        if done:
            sid, p = next(iter(done.items()))
            raise AssertionError(f"session {sid} ended before the others were up: {p.communicate()}")
        time.sleep(0.05)
    raise AssertionError("the sessions did not come up")


def finish(procs: dict[str, subprocess.Popen[str]]) -> dict[str, dict[str, Any]]:
    out = {}
    for sid, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=120)
        finally:
            steps_file(sid).unlink(missing_ok=True)
        assert p.returncode == 0 and "DENIED" not in stdout, (sid, stdout, stderr)
        out[sid] = json.loads(stdout.strip().splitlines()[-1])
    return out


def make_project(env: Env, user: User, with_git: bool) -> Path:
    """The env's project with files, ignored ones (.env, build/) and start_waiting's empty barrier/; as
    a git repository of the user's (committed) when ``with_git``."""
    p = env.project
    for rel, text in (("a.txt", "a\n"), ("b.txt", "b\n"), ("c.txt", "c\n"), ("keep.txt", "keep\n"),
                      ("d/x.txt", "x\n"), (".gitignore", ".env\nbuild/\n"), (".env", "TOKEN=human-secret\n"),
                      ("build/out.o", "object\n"), ("barrier/go", "")):
        write(user, p / rel, text)
    (p / "barrier" / "go").unlink()
    if with_git:
        git(user, p, "init", "-q", "-b", "main")
        git(user, p, "add", "-A")
        git(user, p, "commit", "-qm", "base")
    return p


@pytest.fixture
def repo(env: Env, user: User) -> Path:
    return make_project(env, user, True)


def barrier(user: User, project: Path) -> None:
    """start_waiting's barrier/, empty (untracked: the human's)."""
    write(user, project / "barrier" / "go", "")
    (project / "barrier" / "go").unlink()


@pytest.fixture
def user_env(env: Env, user: User) -> Iterator[UserEnv]:
    """The env's project, for the user's own (rootless) sessions: a home of theirs, removed after."""
    home = Path(f"/home/{user.name}")
    home.mkdir(mode=0o700)
    os.chown(home, user.uid, user.gid)
    try:
        yield UserEnv(home / ".local/state/agentcell", env.project, prefix=user.prefix(), home=home)
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(home)], check=False)


@pytest.mark.parametrize("kind", ["git", "plain", "git-rootless"])
def test_four_sessions_at_once_on_one_project_review_and_apply(env: Env, user: User, kind: str,
                                                                request: pytest.FixtureRequest) -> None:
    """One deletes files, one renames, one commits twice (without git: edits twice), one edits what
    another deletes; the human edits another file meanwhile. As root (a per-session account each) and
    as the user (rootless: the user's own sessions)."""
    if kind.endswith("rootless"):
        env = request.getfixturevalue("user_env")
    repo = make_project(env, user, kind.startswith("git"))
    before = digest(repo)
    tag = secrets.token_hex(3)
    ids = {k: f"ws-{k}-{tag}" for k in ("deletes", "renames", "commits", "edits")}
    steps = {
        "deletes": "run rm b.txt d/x.txt",
        "renames": "run mv c.txt c-renamed.txt",
        "commits": ("append keep.txt more\nrun git commit -qam one\nwrite new.txt new\nrun git add new.txt\n"
                    "run git commit -qm two") if kind.startswith("git") else "append keep.txt more\nwrite new.txt new",
        # b.txt: what 'deletes' deletes. The .env is masked as in any cell; build/ is what git ignores.
        "edits": f"run sh -c \"test ! -e .env && test {'!' if kind != 'plain' else ''} -e build\"\n"
                 "append b.txt agent",
    }
    procs = {ids[k]: start_waiting(env, ids[k], s) for k, s in steps.items()}
    try:
        wait_ready(env, procs)
        # Meanwhile the human edits a file none of them touches, and leaves it uncommitted.
        write(user, repo / "a.txt", "a\nthe human's own edit\n")
        write(user, repo / "barrier" / "go", "")
        summaries = finish(procs)
    finally:
        for sid, p in procs.items():
            if p.poll() is None:
                p.kill()
                p.wait()
            steps_file(sid).unlink(missing_ok=True)
        (repo / "barrier" / "go").unlink(missing_ok=True)
    assert all(s["status"] == "completed" for s in summaries.values()), summaries
    # Four sessions, four accounts, four change sets; the human's tree and .git untouched byte for byte.
    assert len({s["os_user"] for s in summaries.values()}) == (1 if isinstance(env, UserEnv) else 4), summaries
    assert digest(repo, skip=("a.txt", "barrier")) == {k: v for k, v in before.items()
                                                        if k not in ("a.txt", "barrier")}

    r = {k: review(env, sid) for k, sid in ids.items()}
    assert changes(r["deletes"]) == {("deleted", "b.txt"), ("deleted", "d/x.txt")}, r["deletes"]
    assert changes(r["renames"]) == {("renamed", "c-renamed.txt", "c.txt")}, r["renames"]
    assert changes(r["edits"]) == {("modified", "b.txt")}, r["edits"]
    assert "+agent" in r["edits"]["changes"][0]["diff"]
    if kind != "plain":
        assert [c["subject"] for c in r["commits"]["commits"]] == ["two", "one"], r["commits"]
        assert all(c["committed"] for c in r["commits"]["changes"]) and r["commits"]["branch"] == \
            f"agentcell/{ids['commits']}", r["commits"]
    else:
        assert changes(r["commits"]) == {("modified", "keep.txt"), ("added", "new.txt")}, r["commits"]
        assert r["commits"]["branch"] is None and r["commits"]["commits"] == []
    p = cli(env, "list", "--unapplied", "--json")
    assert {w["session"] for w in json.loads(p.stdout)} == set(ids.values()), p.stdout

    assert cli(env, "apply", ids["deletes"]).returncode == 0
    assert cli(env, "apply", ids["renames"]).returncode == 0
    assert not (repo / "b.txt").exists() and not (repo / "d" / "x.txt").exists()
    assert (repo / "c-renamed.txt").read_text() == "c\n" and not (repo / "c.txt").exists()
    # The one that edited what another deleted: refused, the path named, nothing written.
    now = digest(repo)
    p = cli(env, "apply", ids["edits"])
    assert p.returncode == 125 and "b.txt" in p.stderr and "nothing was written" in p.stderr, p.stderr
    assert digest(repo) == now
    assert cli(env, "apply", ids["commits"]).returncode == 0
    assert (repo / "a.txt").read_text() == "a\nthe human's own edit\n"  # survived every apply
    if kind != "plain":
        # The committer's commits arrive as a branch, in the human's own repository, as the human's.
        log = git(user, repo, "log", "--format=%s", f"agentcell/{ids['commits']}").split()
        assert log == ["two", "one", "base"], log
        assert not (repo / "new.txt").exists()  # committed work comes with the branch, not into the tree
        git(user, repo, "merge", "-q", "--ff-only", f"agentcell/{ids['commits']}")
        status = git(user, repo, "status", "--porcelain")
        assert " M a.txt" in status and " D b.txt" in status, status
        git(user, repo, "gc", "-q")
    assert (repo / "keep.txt").read_text() == "keep\nmore\n" and (repo / "new.txt").read_text() == "new\n"
    owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in repo.rglob("*")}
    assert owners == {(user.uid, user.gid)}, owners  # nothing the human cannot work with

    for sid in ids.values():
        assert cli(env, "discard", sid).returncode == 0
        assert not (env.state / "workspaces" / sid).exists()
    events = {(r["session"], r["event"]) for sid in ids.values() for r in records(env, sid)}
    for sid in ids.values():
        assert {(sid, "session.review"), (sid, "session.discard")} <= events
    applied = [r for r in records(env, ids["deletes"]) if r["event"] == "session.apply"]
    assert applied and sorted(applied[0]["details"]["paths"]) == ["b.txt", "d/x.txt"], applied
    if kind != "plain":
        assert applied[0]["details"]["base"]["commit"] == git(user, repo, "rev-parse", "HEAD~2").strip()


def test_a_human_edit_of_what_the_agent_edited_is_taken_only_when_asked(env: Env, user: User) -> None:
    """--theirs takes the agent's where asked; a link the agent made lands as a link."""
    p = env.project
    barrier(user, p)
    sid = f"ws-plain-{secrets.token_hex(3)}"
    procs = {sid: start_waiting(env, sid, "rm docs/notes.md; echo y = 2 >> src/app.py; echo new > src/new.py; "
                                          "ln -s app.py src/link.py", harness="shell")}
    try:
        wait_ready(env, procs)
        write(user, p / "src" / "app.py", "x = 1\nhuman = True\n")
        write(user, p / "README", "hello, edited\n")
        write(user, p / "barrier" / "go", "")
        finish(procs)
    finally:
        (p / "barrier" / "go").unlink(missing_ok=True)
    r = review(env, sid)
    assert changes(r) == {("deleted", "docs/notes.md"), ("modified", "src/app.py"), ("added", "src/new.py"),
                          ("added", "src/link.py")}, r
    assert [c["path"] for c in r["changes"] if c["conflict"]] == ["src/app.py"]
    before = digest(p)
    res = cli(env, "apply", sid)
    assert res.returncode == 125 and "src/app.py" in res.stderr and digest(p) == before, res.stderr
    assert cli(env, "apply", sid, "--theirs", "src/app.py").returncode == 0
    assert (p / "src" / "app.py").read_text() == "x = 1\ny = 2\n" and (p / "src" / "new.py").read_text() == "new\n"
    assert os.readlink(p / "src" / "link.py") == "app.py" and not (p / "docs" / "notes.md").exists()
    assert (p / "README").read_text() == "hello, edited\n"  # the human's own change stays
    assert not list(p.rglob(".agentcell-aside-*"))
    assert cli(env, "apply", sid).returncode == 125  # once
    assert cli(env, "discard", sid).returncode == 0


def test_an_ignored_file_is_hidden_unless_included_and_bad_input_is_refused(env: Env, user: User, repo: Path) -> None:
    s = session(env, ["start", "--workspace", "copy", "--workspace-include", ".env", "--harness", "shell", "--json",
                      "--", "sh", "-c", "cat .env; test ! -e build && echo build-hidden"])
    assert s.summary["status"] == "completed" and "TOKEN=human-secret" in s.out and "build-hidden" in s.out, s.out
    assert cli(env, "discard", s.summary["session"]).returncode == 0
    for flags, name in ((["--workspace", "copy", "--workspace-include", "../x"], "--workspace-include"),
                        (["--workspace-include", ".env"], "--workspace-include"),
                        (["--workspace", "cow"], "--workspace")):
        s = session(env, ["start", *flags, "--harness", "shell", "--", "true"])
        assert s.rc != 0 and name in s.err and len(s.err.strip().splitlines()) == 1, s.err
    p = cli(env, "apply", "no-such-session")
    assert p.returncode == 125 and "no workspace" in p.stderr, p.stderr


def test_a_change_set_survives_a_killed_supervisor_and_recover(env: Env, user: User, repo: Path) -> None:
    sid = f"ws-crash-{secrets.token_hex(3)}"
    procs = {sid: start_waiting(env, sid, "echo changed > a.txt", harness="shell")}
    wait_ready(env, procs)
    proc = procs[sid]
    os.kill(proc.pid, signal.SIGKILL)  # the supervisor we started, by its pid
    proc.communicate(timeout=60)
    p = cli(env, "recover")
    assert p.returncode == 0, p.stderr
    st = json.loads(cli(env, "show", sid, "--json").stdout)
    assert st["finished"] and account_gone((st.get("account") or {}).get("name")), st
    r = review(env, sid)
    assert ("modified", "a.txt") in changes(r), r
    assert cli(env, "apply", sid).returncode == 0
    assert (repo / "a.txt").read_text() == "changed\n" and (repo / "a.txt").stat().st_uid == user.uid
    assert cli(env, "discard", sid).returncode == 0


def shell_session(env: Env, script: str, *flags: str) -> str:
    """A --workspace copy session of the shell harness running ``script``; its id."""
    s = session(env, ["start", "--workspace", "copy", "--harness", "shell", "--json", *flags, "--", "sh", "-c",
                      script])
    assert s.summary.get("status") == "completed", (s.out, s.err)
    return str(s.summary["session"])


def test_a_repository_the_agent_could_not_see_never_comes_in(env: Env, user: User, repo: Path) -> None:
    """The agent points its .git at the human's private repository (a link, or alternates): its
    'commits' are refused, and nothing of that repository reaches the project's."""
    private = env.project.parent / f"agentcell-test-private-{secrets.token_hex(3)}"
    try:
        write(user, private / "creds.txt", "AWS_SECRET=hunter2\n")
        git(user, private, "init", "-q", "-b", "main")
        git(user, private, "add", "-A")
        git(user, private, "commit", "-qm", "private")
        os.chmod(private, 0o700)
        secret = git(user, private, "rev-parse", "HEAD").strip()
        for script in (f"rm -rf .git && ln -s {private}/.git .git",
                       f"echo {private}/.git/objects > .git/objects/info/alternates && echo {secret} > "
                       ".git/refs/heads/main"):
            sid = shell_session(env, script + "; true")
            r = review(env, sid)
            assert r["branch"] is None and r["commits"] == [] and r["git_problem"], r
            p = cli(env, "apply", sid)
            assert p.returncode == 0 and "commits were not taken" in p.stderr, p.stderr
            assert as_user(user, "git", "cat-file", "-e", secret, cwd=repo, check=False).returncode != 0
            assert cli(env, "discard", sid).returncode == 0
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(private)], check=False)


def test_what_decides_execution_lands_only_when_named(env: Env, user: User, repo: Path) -> None:
    """A hook's worth of change (.envrc; a nested repository with its own config; a hook in the
    directory the project's git config names; a directory shaped like a bare repository) is flagged in
    review and refused by apply until --theirs names it; a commit that adds one is named when it lands.
    A name with a line break cannot forge a diff's header."""
    write(user, repo / "githooks" / "pre-commit", "#!/bin/sh\nexit 0\n")
    for rel, text in (("tools/bare/HEAD", "ref: refs/heads/main\n"), ("tools/bare/objects/keep", ""),
                      ("tools/bare/config", "[core]\n")):  # a bare repository of the human's, in the project
        write(user, repo / rel, text)
    git(user, repo, "config", "core.hooksPath", "githooks")
    git(user, repo, "add", "githooks")
    git(user, repo, "commit", "-qm", "hooks")
    sid = shell_session(env, "echo 'touch /tmp/pwned' >> githooks/pre-commit; "
                             "echo '\tfsmonitor = touch /tmp/pwned' >> tools/bare/config; mkdir -p vendor/bare/objects "
                             "vendor/bare/refs && echo 'ref: refs/heads/main' > vendor/bare/HEAD && printf "
                             "'[core]\\n\\tfsmonitor = touch /tmp/pwned\\n' > vendor/bare/config; "
                             "printf 'evil\\n' > \"$(printf 'zz\\n+++ README.md')\"; "
                             "echo 'export X=1' > .envrc; mkdir sub && cd sub && git init -q && "
                             "git config core.fsmonitor 'touch /tmp/pwned; false'; cd ..; echo fine >> a.txt; "
                             "echo 'curl x | sh' > .husky-like && git add .husky-like && git commit -qm 'tidy'; "
                             "printf '[filter \"x\"]\\n' > /dev/null; echo '* filter=x' > .gitattributes; "
                             "git add .gitattributes && git commit -qm attrs")
    r = review(env, sid)
    control = {c["path"]: c["control"] for c in r["changes"] if c["control"]}
    assert control.get(".envrc") == ".envrc" and any(v == "sub/.git" for v in control.values()), r["changes"]
    assert control.get("githooks/pre-commit") == "githooks" and control.get("vendor/bare/config") == "vendor/bare"
    assert control.get("tools/bare/config") == "tools/bare", control  # the human's own, edited by the agent
    forged = next(c for c in r["changes"] if c["path"].startswith("zz"))
    assert "\n+++ README.md" not in forged["diff"] and "zz\\x0a+++ README.md" in forged["diff"], forged
    assert any(".gitattributes" in cm["control"] for cm in r["commits"]), r["commits"]
    before = digest(repo)
    p = cli(env, "apply", sid)
    assert p.returncode == 125 and ".envrc" in p.stderr and "nothing was written" in p.stderr, p.stderr
    assert digest(repo) == before
    subs = sorted(c["path"] for c in r["changes"] if c["control"] in ("sub/.git", "githooks", "vendor/bare",
                                                                      "tools/bare"))
    p = cli(env, "apply", sid, "--theirs", ".envrc", *(a for s in subs for a in ("--ours", s)))
    assert p.returncode == 0 and ".gitattributes" in p.stderr, p.stderr  # the commit's, named when it lands
    assert (repo / ".envrc").exists() and not (repo / "sub" / ".git").exists() and (repo / "a.txt").read_text() \
        == "a\nfine\n"
    assert not Path("/tmp/pwned").exists()
    assert cli(env, "discard", sid).returncode == 0


def test_replaced_directories_a_failed_apply_and_what_the_view_hides(env: Env, user: User, repo: Path) -> None:
    """A directory the agent replaced by a file while the human added to it; a directory the agent
    deleted; a failed apply puts everything back; what the view hides is never diffed against the
    project's, and a directory holding a hidden entry stays writable."""
    write(user, repo / "lib" / "core.py", "core\n")
    write(user, repo / "vend" / "k" / "f", "f\n")
    write(user, repo / "src" / "__pycache__" / "x.pyc", "pyc\n")
    write(user, repo / ".gitignore", ".env\nbuild/\n__pycache__/\n")
    as_user(user, "chmod", "0555", str(repo / "vend" / "k"), cwd=repo)
    sid = shell_session(env, "set -e; rm -rf lib && echo x > lib; chmod -R u+w vend && rm -rf d vend; "
                             "echo agent-env > .env; echo new > src/new.py; echo y >> a.txt; "
                             "mkdir -p src/__pycache__ && echo built > src/__pycache__/y.pyc; "
                             "mkdir -p newdir && echo n > newdir/f.txt")
    r = review(env, sid)
    got = changes(r)
    assert {("deleted", "d"), ("deleted", "vend"), ("type", "lib"), ("added", "src/new.py")} <= got, got
    assert next(c for c in r["changes"] if c["path"] == "vend")["removes"] == ["vend/k/f"]
    assert next(c for c in r["changes"] if c["path"] == "src/__pycache__/y.pyc")["ignored"]  # build output
    env_change = next(c for c in r["changes"] if c["path"] == ".env")
    assert "human-secret" not in json.dumps(r) and env_change["conflict"], env_change
    # Meanwhile the human adds to the directory the agent replaced, and puts a file where the agent
    # made a directory: a conflict, and a failed apply.
    write(user, repo / "lib" / "mine.py", "mine\n")
    lib = next(c for c in r["changes"] if c["path"] == "lib")
    assert not lib["conflict"] and lib["removes"] == ["lib/core.py"]
    assert review(env, sid)["changes"][[c["path"] for c in review(env, sid)["changes"]].index("lib")]["conflict"]
    write(user, repo / "newdir", "a file of the human's\n")
    before = digest(repo)
    p = cli(env, "apply", sid, "--ours", ".env", "--theirs", "lib")
    assert p.returncode == 125 and "nothing was written" in p.stderr, p.stderr
    assert digest(repo) == before and not list(repo.rglob(".agentcell-aside-*"))
    (repo / "newdir").unlink()
    p = cli(env, "apply", sid, "--ours", ".env", "--theirs", "lib")
    assert p.returncode == 0, p.stderr
    assert (repo / "lib").read_text() == "x\n" and not (repo / "vend").exists() and not (repo / "d").exists()
    assert (repo / "src" / "new.py").read_text() == "new\n" and (repo / ".env").read_text() == "TOKEN=human-secret\n"
    assert not list(repo.rglob(".agentcell-aside-*"))
    assert not (repo / "src" / "__pycache__" / "y.pyc").exists() and (repo / "src" / "__pycache__" / "x.pyc").exists()
    assert cli(env, "discard", sid).returncode == 0


def test_what_git_ignores_is_judged_even_beside_a_path_git_refuses(tmp_path: Path) -> None:
    """check-ignore refuses a whole batch for one path beyond a link (exit 128); the rest are still
    judged one by one, and the refused one counts as not ignored."""
    from agentcell.workspace.review import _ignored_paths

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("*.pyc\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "lnk").symlink_to("d")
    assert _ignored_paths(str(tmp_path), ["a.pyc", "b.py", "lnk/f.pyc"]) == {"a.pyc"}
    assert _ignored_paths(str(tmp_path), ["a.pyc", "b.py"]) == {"a.pyc"}
