"""Faults and bad input (issue 13): what an operator does to agentcell by mistake, or a full disk does to
it, ends in one line and a clean state, never a hang or a traceback. Each test is one item of the issue.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import AGENTCELL, needs_root
from sessionkit import Env, running, scripted, session, session_environ

pytestmark = needs_root


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30, cwd: str | None = None,
        as_user: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **(env or {})}
    p = subprocess.run([*(as_user or []), AGENTCELL, *args], capture_output=True, text=True, env=base,
                       timeout=timeout, cwd=cwd or "/", stdin=subprocess.DEVNULL)
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A 2 MiB tmpfs of 64 inodes of the test's own (named agentcell: the stop hook lists leftovers)."""
    d = Path("/tmp") / f"agentcell-test-fs-{secrets.token_hex(3)}"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=64,mode=0700", "agentcell-test", str(d)],
                   check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)
        d.rmdir()


# ---- 2: the audit trail's readers ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "zero", "dir", "link to a dir"])
def test_audit_commands_read_only_a_regular_file_and_never_hang(tmp_path: Path, kind: str) -> None:
    target = {"zero": Path("/dev/zero")}.get(kind, tmp_path / "trail")
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    elif kind == "link to a dir":
        (tmp_path / "d").mkdir()
        target.symlink_to(tmp_path / "d")
    for cmd in (["verify"], ["show"], ["tail"]):
        p = cli("audit", *cmd, str(target), timeout=20)
        assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, (cmd, p.stderr)
        assert "is a" in p.stderr or "not a regular file" in p.stderr, p.stderr


def test_a_trail_whose_session_did_not_end_is_incomplete_unless_running_ones_are_accepted(tmp_path: Path) -> None:
    from agentcell.audit.trail import AuditLog

    log = AuditLog(str(tmp_path / "audit" / "audit.jsonl"))
    log.append("session.plan", session="s-done")
    log.append("session.end", session="s-done")
    log.append("session.plan", session="s-cut")
    log.append("session.spawn", session="s-cut")
    p = cli("audit", "verify", log.path)
    assert p.returncode == 1 and "session s-cut has no session.end record" in p.stdout, p.stdout
    assert "s-done" not in p.stdout
    p = cli("audit", "verify", log.path, "--running")
    assert p.returncode == 0 and "4 records, chain intact, 1 session(s) not ended yet" in p.stdout, p.stdout


# ---- 3: a path that is not UTF-8 ---------------------------------------------------------------------

def test_a_project_whose_name_is_not_utf8_runs_a_whole_session(env: Env) -> None:
    odd = env.state.parent / os.fsdecode(b"agentcell-test-p\xff" + secrets.token_hex(2).encode())
    shutil.copytree(env.project, odd, symlinks=True)
    os.chown(odd, env.project.stat().st_uid, env.project.stat().st_gid)
    try:
        p = subprocess.run([AGENTCELL, "session", "start", "--harness", "shell", "--json", "--", "sh", "-c",
                            "echo changed > src/app.py"], capture_output=True, env=session_environ(env), cwd=odd,
                           stdin=subprocess.DEVNULL, timeout=120)
        err = p.stderr.decode("utf-8", "replace")
        assert "Traceback" not in err and p.returncode == 0, err
        summary = json.loads(p.stdout.decode().strip().splitlines()[-1])
        assert summary["status"] == "completed" and (odd / "src" / "app.py").read_text() == "changed\n"
        assert session(env, ["restore", summary["session"]]).rc == 0
        assert (odd / "src" / "app.py").read_text() == "x = 1\n"
    finally:
        subprocess.run([AGENTCELL, "session", "recover"], env=session_environ(env), capture_output=True)
        shutil.rmtree(odd, ignore_errors=True)


# ---- 4, 5: root's records never in the project; a named --env-file exists --------------------------

@pytest.mark.parametrize("flag", ["--audit-log", "--backup-dir"])
def test_roots_records_are_never_put_where_the_agent_writes(env: Env, flag: str) -> None:
    inside = env.project / "records" / ("audit.jsonl" if flag == "--audit-log" else "backups")
    s = session(env, ["start", "--harness", "shell", flag, str(inside), "--", "true"])
    assert s.rc == 125 and len(s.err.strip().splitlines()) == 1 and "lies in the project" in s.err, s.err
    assert not (env.project / "records").exists() and not (env.state / "sessions").exists()


def test_the_state_dir_is_never_where_the_agent_writes(env: Env) -> None:
    s = session(env, ["start", "--harness", "shell", "--", "true"],
                extra={"AGENTCELL_STATE_DIR": str(env.project / "state")})
    assert s.rc == 125 and "AGENTCELL_STATE_DIR" in s.err and "lies in the project" in s.err, s.err
    assert not (env.project / "state").exists()


def test_an_env_file_that_does_not_exist_is_refused_not_ignored(env: Env) -> None:
    s = session(env, ["start", "--harness", "shell", "--env-file", str(env.state / "nope.env"), "--", "true"])
    assert s.rc == 125 and s.err.strip() == (f"agentcell session: --env-file: {env.state}/nope.env does not exist "
                                             "(name an existing .env file)"), s.err


# ---- 6: a trail that fills mid-session --------------------------------------------------------------

def test_a_session_whose_trail_fills_ends_at_once_and_its_trail_says_it_is_incomplete(
        env: Env, small_fs: Path) -> None:
    audit = small_fs / "audit.jsonl"
    sup = running(env, extra={"AUDIT_LOG_PATH": str(audit)})
    try:
        assert sup.poll() is None, "the session ended before its cell ran"
        fill = small_fs / "fill"
        subprocess.run(["dd", "if=/dev/zero", f"of={fill}", "bs=64k"], capture_output=True)  # until it is full
        out, _ = sup.communicate(timeout=60)  # the agent sleeps 600 s: only the full trail ends it
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "terminated" and "audit log cannot be written" in summary["reason"], summary
    assert "is full" in summary["reason"]
    fill.unlink()
    # What was written is whole: either the teardown's records fit in what was left (the anchor needs
    # no new inode or block) and the trail ends with session.end, or it says it is incomplete.
    p = cli("audit", "verify", str(audit))
    from agentcell.audit.trail import records

    events = [r["event"] for r in records(str(audit), summary["session"])]
    if p.returncode == 0:
        assert "chain intact" in p.stdout and events[-1] == "session.end", (p.stdout, events)
        assert "session.tick" not in events[events.index("session.spawn"):-3], events  # ended at once, no tick
    else:
        assert p.returncode == 1 and f"session {summary['session']} has no session.end record" in p.stdout, p.stdout


# ---- 7: a backup that fails leaves nothing ----------------------------------------------------------

@pytest.mark.parametrize("case", ["no room", "no inodes"])
def test_a_backup_that_fails_leaves_nothing_in_the_store(tmp_path: Path, small_fs: Path, case: str) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    if case == "no room":  # each file fits, not both: the 90 % rule is the whole backup's
        for name in ("a.bin", "b.bin"):
            (tree / name).write_bytes(os.urandom(1000 << 10))
    else:
        for i in range(100):
            (tree / f"f{i}.txt").write_text(f"{i}\n")
    store = small_fs / "store"
    p = cli("snapshot", "take", str(tree), "--store", str(store))
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert ("does not fit" in p.stderr) if case == "no room" else ("No space left" in p.stderr), p.stderr
    assert not any(f.is_file() for f in (store / "objects").rglob("*")), list((store / "objects").rglob("*"))
    assert not list((store / "snapshots").glob("*.json"))


# ---- 8, 9, 10: agentcell run, rootless, and long values ---------------------------------------------

@pytest.mark.parametrize("mask", ["/", "/.", "//", "/etc/..", "/proc", "/dev/shm"])
def test_a_mask_over_the_whole_system_or_the_cells_own_is_refused_in_one_line(mask: str) -> None:
    p = cli("run", "--as", "65534", "--mask", mask, "--", "true")
    assert p.returncode == 125 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "a mask over it would leave nothing to run" in p.stderr, p.stderr


def test_a_rootless_run_ended_at_an_escape_never_exits_zero(nobodys: Path) -> None:
    p = cli("run", "--no-warm", "--monitor", "--json", "--", "sh", "-c", "cat ~/.ssh/id_ed25519 >/dev/null; echo fast",
            env={"HOME": str(nobodys)}, cwd=str(nobodys),
            as_user=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"])
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["terminated_by_monitor"] is True and p.returncode == 137 and result["exit_status"] == 137, result


@pytest.fixture
def nobodys() -> Iterator[Path]:
    """A directory nobody (65534) owns, not below pytest's own (0700) directories."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="agentcell-test-nobody-"))
    os.chmod(d, 0o755)
    os.chown(d, 65534, 65534)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_user_who_is_not_root_is_told_what_fits_them(nobodys: Path) -> None:
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    home, project = nobodys / "home", nobodys / "project"
    for d in (home, project):
        d.mkdir()
        os.chown(d, 65534, 65534)
    p = cli("agent", "list", env={"HOME": str(home)}, as_user=nobody)
    assert p.returncode == 125 and "agent accounts are root's" in p.stderr and "sudo" in p.stderr, p.stderr
    (project / "a.txt").write_text("a\n")
    os.chown(project / "a.txt", 65534, 65534)
    p = cli("snapshot", "take", str(project), env={"HOME": str(home)}, as_user=nobody)
    assert p.returncode == 0, p.stderr
    assert list((home / ".local/state/agentcell/snapshots/snapshots").glob("*.json"))  # the XDG state dir


def test_an_error_does_not_repeat_a_huge_value_in_full() -> None:
    huge = "x" * 100_000
    for args in (["run", "--as", "65534", "--rw", huge, "--", "true"], ["session", "start", "--harness", huge],
                 ["run", "--as", "65534", "--limits", huge, "--", "true"]):
        p = cli(*args)
        assert p.returncode == 125 and len(p.stderr) < 2000 and len(p.stderr.strip().splitlines()) == 1, args
        assert " characters) …" in p.stderr, p.stderr  # it says how long it was


# ---- what the fuzzer found (tests/test_fuzz.py): each a case of its own ------------------------------

@pytest.mark.parametrize("sid", [os.fsdecode(b"\x80"), "x" * 100_000, "../../etc", "a b"])
@pytest.mark.parametrize("cmd", ["show", "stop", "restore", "diff"])
def test_a_session_id_that_is_not_one_is_refused_in_one_line(tmp_path: Path, cmd: str, sid: str) -> None:
    p = subprocess.run([AGENTCELL, "session", cmd, sid], capture_output=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "AGENTCELL_STATE_DIR": str(tmp_path)})
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 125 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "is not a session id" in err and len(err) < 400, err


# ---- the red team's round on this issue (helper 10) ---------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_an_audit_anchor_that_is_a_fifo_or_a_link_is_damaged_and_never_waited_on(tmp_path: Path, kind: str) -> None:
    from agentcell.audit.trail import AuditLog, AuditWriteError

    log = AuditLog(str(tmp_path / "audit" / "audit.jsonl"))
    log.append("session.plan", session="s-1")
    good = Path(log.head).read_text()
    os.unlink(log.head)
    if kind == "fifo":
        os.mkfifo(log.head)
    else:  # a link to a file that says what the anchor said: followed, the trail would look whole
        (tmp_path / "elsewhere").write_text(good)
        os.symlink(tmp_path / "elsewhere", log.head)
    p = cli("audit", "verify", log.path, timeout=20)
    assert p.returncode == 1 and "audit.jsonl.head is damaged" in p.stdout, p.stdout
    with pytest.raises(AuditWriteError, match="does not end where its anchor says"):
        log.append("session.end", session="s-1")  # root's append neither blocks nor reads through it


def test_nesting_thousands_deep_is_refused_in_one_line(env: Env, tmp_path: Path) -> None:
    from agentcell.errors import PolicyError
    from agentcell.policy.compile import load_plan
    from agentcell.session.config import read_toml

    deep = "x = " + "[" * 5000 + "1" + "]" * 5000 + "\n"
    (env.project / "agentcell.toml").write_text("[session]\n" + deep)
    with pytest.raises(PolicyError, match="nested too deep"):
        read_toml(str(env.project))
    (tmp_path / "plan.toml").write_text(deep)
    with pytest.raises(PolicyError, match="nested too deep"):
        load_plan(tmp_path / "plan.toml")
    from agentcell.audit.trail import AuditLog

    log = AuditLog(str(tmp_path / "audit" / "audit.jsonl"))
    log.append("session.plan", session="s-1")
    with open(log.path, "ab") as f:
        f.write(b"[" * 100_000 + b"\n")
    for cmd in ("verify", "show"):
        p = cli("audit", cmd, log.path)  # (cli: never a traceback)
        assert p.returncode != 0 or cmd == "show", (cmd, p.stdout, p.stderr)
    assert "not a JSON record" in cli("audit", "verify", log.path).stdout


def test_an_append_needs_no_new_inode(small_fs: Path) -> None:
    from agentcell.audit.trail import AuditLog, verify

    log = AuditLog(str(small_fs / "audit" / "audit.jsonl"))
    log.append("session.plan", session="s-1")
    n = 0
    with pytest.raises(OSError):
        while True:  # what a cell does to the file system its trail shares: no inode left
            (small_fs / f"f{n}").touch()
            n += 1
    log.append("session.escape", session="s-1")  # its own escape attempt is still recorded
    log.append("session.end", session="s-1")
    v = verify(log.path)
    assert v.ok and v.records == 3 and not v.unfinished, v.problems


def test_an_escape_whose_record_cannot_be_written_is_still_the_sessions_verdict(env: Env) -> None:
    s = scripted(env, "read ~/.ssh/id_rsa\nsleep 30\n", "--rw", "src", "--wall-clock", "60",
                 extra={"AGENTCELL_TEST_FAULTS": "audit@monitor=1"})
    assert s.rc == 120 and s.summary["status"] == "terminated", (s.summary, s.err)
    assert s.summary["escape"]["operation"] == "read" and s.summary["escape"]["source"] == "canary", s.summary
    assert "not in the audit log" in s.summary["reason"], s.summary


# ---- found by the fuzzer ------------------------------------------------------------------------------

@pytest.mark.parametrize("store", ["//", "/etc", "a directory of other things"])
def test_a_store_among_other_things_is_refused_and_nothing_is_made_there(tmp_path: Path, store: str) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("a\n")
    if store.startswith("a directory"):
        store = str(tmp_path / "mine")
        os.mkdir(store, 0o700)
        (Path(store) / "notes.txt").write_text("mine\n")
    before = sorted(os.listdir(store))
    p = cli("snapshot", "take", str(tree), "--store", store)
    assert p.returncode != 0 and "so it is not a snapshot store" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and sorted(os.listdir(store)) == before
    p = cli("snapshot", "take", str(tree), "--store", str(tmp_path / "new"))  # a new one, then the same again
    assert p.returncode == 0 and cli("snapshot", "take", str(tree), "--store", str(tmp_path / "new")).returncode == 0


@pytest.mark.parametrize("kind", ["fifo", "link", "hard link"])
def test_a_spare_anchor_that_is_not_a_plain_file_of_ours_is_not_used_nor_waited_on(tmp_path: Path, kind: str) -> None:
    from agentcell.audit.trail import AuditLog, verify

    log = AuditLog(str(tmp_path / "audit" / "audit.jsonl"))
    log.append("session.plan", session="s-1")
    spare = Path(log.head + ".spare")
    spare.unlink()
    other = tmp_path / "other"
    other.write_text("x" * 128)
    if kind == "fifo":
        os.mkfifo(spare)
    elif kind == "link":
        spare.symlink_to(other)
    else:
        os.link(other, spare)
    log.append("session.end", session="s-1")  # neither blocks on the FIFO nor writes through the links
    assert other.read_text() == "x" * 128
    v = verify(log.path)
    assert v.ok and v.records == 2, v.problems
    assert spare.is_file() and not spare.is_symlink() and spare.stat().st_nlink == 1  # a new spare, of ours
