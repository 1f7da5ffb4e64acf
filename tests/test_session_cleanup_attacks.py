"""Red-team pass on a session's cleanup: the per-session account's files given back in the walk that
revokes its grant (session/nodes/teardown.py ``_given_in_revoke``, accounts/acl.py ``revoke(give_to=)``),
its processes killed first (accounts/accounts.py ``kill_all``), and the account made by one useradd.

Tests marked ``xfail(strict=True)`` demonstrate a bug found by this pass: they pass (as an expected
failure) while the bug is there, and turn into an error once it is fixed, so that the mark is removed.
"""
from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import AGENTCELL, User, needs_root
from sessionkit import Env, account_gone, acl_names, session, session_environ

pytestmark = needs_root


@pytest.fixture
def mallory() -> Iterator[User]:
    """Another local user of the host, neither the human nor the agent."""
    name = "ac-m" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-d", f"/home/{name}", "-s", "/usr/sbin/nologin", name], check=True)
    pw = pwd.getpwnam(name)
    try:
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@dataclass
class Seen:
    summary: dict[str, Any]
    agent_gid: int
    wrote_humans_file: bool  # mallory, through the agent's group
    survivor: subprocess.Popen[str]  # mallory's process that ran the agent's setgid file
    survivor_gids: str  # its Gid line after the session ("" if it has gone)


def _agents_setgid_tool_run_by_another_user(env: Env, mallory: User, who: tuple[str, ...] = ()) -> Seen:
    """The agent copies an interpreter into the project and tries to set its setgid bit (the cell's mounts
    are nosuid; the host's view of the project is not: the cell's seccomp filter refuses the bit); while the
    session runs, another local user runs it, a process outside any cell, which then sleeps. The session
    ends."""
    src = env.project / "src"
    script = (f"cd {src} && cp /usr/bin/python3.11 tool && (chmod 2755 tool || echo refused); touch ready && "
              "while [ ! -e go ]; do sleep 0.1; done; echo done")
    sup = subprocess.Popen([AGENTCELL, "session", "start", "--harness", "shell", *who, "--rw", "src", "--json", "--",
                            "sh", "-c", script], env=session_environ(env), cwd=env.project, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    survivor = None
    try:
        for _ in range(1200):
            if (src / "ready").exists() or sup.poll() is not None:
                break
            time.sleep(0.05)
        assert (src / "ready").exists(), sup.communicate(timeout=60)
        agent_gid = (src / "tool").stat().st_gid
        code = ("import os, sys, time\n"
                "try:\n"
                f"    open({str(src / 'app.py')!r}, 'a').write('# mallory\\n')\n"
                "    print('wrote', flush=True)\n"
                "except OSError:\n"
                "    print('refused', flush=True)\n"
                "time.sleep(600)\n")
        survivor = subprocess.Popen([*mallory.prefix(), str(src / "tool"), "-c", code], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, stdin=subprocess.DEVNULL)
        assert survivor.stdout is not None
        wrote = survivor.stdout.readline() == "wrote\n"
        (src / "go").touch()
        out, err = sup.communicate(timeout=120)
        assert sup.returncode == 0, err
        summary = json.loads(out.splitlines()[-1])
        try:
            status = Path(f"/proc/{survivor.pid}/status").read_text()
            gids = next(line for line in status.splitlines() if line.startswith("Gid:"))
        except OSError:
            gids = ""
        return Seen(summary, agent_gid, wrote, survivor, gids if survivor.poll() is None else "")
    except BaseException:
        if survivor is not None:
            survivor.kill()
            survivor.wait()
        raise
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


@pytest.mark.xfail(strict=True, reason="BUG (older than this change): the agent can set the setgid bit on a file it "
                   "makes in a declared path with chmod (the filter refuses setuid, and setgid on creating calls, but "
                   "cannot tell chmod's setgid on a file from a directory's, which chmod keeps); the cell's mounts "
                   "are nosuid, the host's are not, so a local user who runs it gets the agent's group and grant")
def test_another_local_user_cannot_borrow_the_agents_grant_through_a_setgid_file(env: Env, mallory: User) -> None:
    seen = _agents_setgid_tool_run_by_another_user(env, mallory)
    seen.survivor.kill()
    seen.survivor.wait()
    assert not seen.wrote_humans_file, (env.project / "src" / "app.py").read_text()


def test_no_process_keeps_the_session_accounts_group_after_it_unsaid_nor_lends_it_on(
        env: Env, mallory: User, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another local user's process that ran the agent's setgid file keeps the account's group after the
    account is gone: the summary names it, and no later session's account is given that number (its
    grants would be that process's too)."""
    from agentcell.accounts import ephemeral

    seen = _agents_setgid_tool_run_by_another_user(env, mallory)
    try:
        assert account_gone(seen.summary["os_user"])
        assert all(g.gr_gid != seen.agent_gid for g in grp.getgrall()), "the group is deleted"
        kept = str(seen.agent_gid) in seen.survivor_gids.split()
        said = [p for p in seen.summary["problems"] if f"process {seen.survivor.pid} of {mallory.name}" in p]
        # the next pick draws that number first, then another
        draws = iter([seen.agent_gid - ephemeral.UID_FIRST, 0])
        monkeypatch.setattr(ephemeral.secrets, "randbelow", lambda n: next(draws))
        monkeypatch.setattr(ephemeral, "leftovers", lambda: [])
        picked = ephemeral._free_uid()
    finally:
        seen.survivor.kill()
        seen.survivor.wait()
    # (the premise: chmod's setgid is let through, test above; once it is not, give a process the group directly)
    assert kept, f"the other user's process does not hold the agent's group {seen.agent_gid}: {seen.survivor_gids}"
    assert said, seen.summary["problems"]
    assert picked != seen.agent_gid


def test_a_process_that_keeps_a_persistent_agents_group_is_named_after_each_session(env: Env, mallory: User,
                                                                                     agent: str) -> None:
    """A persistent agent keeps its group from one session to the next: another user's process that ran its
    setgid file would have the next session's grant too. The summary names it."""
    seen = _agents_setgid_tool_run_by_another_user(env, mallory, ("--agent", agent))
    try:
        kept = str(seen.agent_gid) in seen.survivor_gids.split()
        said = [p for p in seen.summary["problems"] if f"process {seen.survivor.pid} of {mallory.name}" in p]
    finally:
        seen.survivor.kill()
        seen.survivor.wait()
    assert kept, f"the other user's process does not hold the agent's group {seen.agent_gid}: {seen.survivor_gids}"
    assert said, seen.summary["problems"]


@pytest.mark.parametrize(("account", "mode"), [("per-session", "777"), ("persistent agent", "777"),
                                             ("per-session", "2777")])
def test_what_another_user_put_in_the_agents_open_directory_is_not_left_theirs_unsaid(
        env: Env, mallory: User, account: str, mode: str, request: pytest.FixtureRequest) -> None:
    """The agent opens a directory to all (setgid too: then what is made there has the agent's group);
    another local user puts a file there during the session. Cleanup gives the directory to the human, not
    writable by others, and names the file, which stays its maker's (taking it could take a file of theirs
    elsewhere, through a hard link) but loses the agent's group."""
    src = env.project / "src"
    script = (f"cd {src} && mkdir plugins && chmod {mode} plugins && touch ready && "
              "while [ ! -e go ]; do sleep 0.1; done; echo done")
    who = ["--agent", request.getfixturevalue("agent")] if account == "persistent agent" else []
    sup = subprocess.Popen([AGENTCELL, "session", "start", "--harness", "shell", *who, "--rw", "src", "--json", "--",
                            "sh", "-c", script], env=session_environ(env), cwd=env.project, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):
            if (src / "ready").exists() or sup.poll() is not None:
                break
            time.sleep(0.05)
        p = subprocess.run([*mallory.prefix(), "sh", "-c", f"echo 'import os' > {src}/plugins/init.py"],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        (src / "go").touch()
        out, err = sup.communicate(timeout=120)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    summary = json.loads(out.splitlines()[-1])
    said = " ".join(summary["problems"] + summary["warnings"])
    plugin = src / "plugins" / "init.py"
    assert not stat.S_IMODE((src / "plugins").stat().st_mode) & stat.S_IWOTH, "the directory itself is made plain"
    assert plugin.stat().st_uid != mallory.uid or "init.py" in said, (plugin.stat().st_uid, said)
    # (cleanup leaves another user's file theirs: a hard link there may be to a file of theirs elsewhere)
    assert f"{plugin} belongs to {mallory.name} (uid {mallory.uid})" in said, said
    assert plugin.stat().st_uid == mallory.uid, "it is left theirs, as said"
    assert plugin.stat().st_gid in (mallory.gid, env.project.stat().st_gid), "not the agent's group"
    assert not (src / "plugins").stat().st_mode & stat.S_ISGID


def test_cleanup_gives_back_no_inode_but_the_accounts_through_links(env: Env, user: User) -> None:
    """HELD. Links the agent makes in a declared path: a hard link to a host file outside it (refused: another
    mount in the cell), a hard link to a root-owned file inside it (allowed: the grant lets the agent write it,
    so protected_hardlinks lets it link it), symlinks to /etc/shadow and to that root file. Cleanup gives back
    the links it owns (the symlinks themselves) and never the inode behind one: every file of root's, here
    and in /etc, keeps its owner, mode and ACL."""
    src = env.project / "src"
    rootfile = src / "root-owned.txt"
    rootfile.write_text("root's\n")
    os.chmod(rootfile, 0o644)
    before = {p: os.stat(p) for p in ("/etc/passwd", "/etc/shadow", str(rootfile))}
    script = (f"cd {src} && mkdir d && (ln /etc/passwd d/pw 2>/dev/null && echo LINKED-ETC || true) && "
              "ln root-owned.txt d/hard && ln -s /etc/shadow d/shadow && ln -s ../root-owned.txt d/soft && "
              "echo mine > d/mine && ln d/mine d/mine2 && echo done")
    s = session(env, ["start", "--harness", "shell", "--rw", "src", "--json", "--", "sh", "-c", script])
    assert s.rc == 0 and s.out.splitlines()[-1] == "done", (s.out, s.err)
    assert "LINKED-ETC" not in s.out
    assert s.summary["problems"] == [] and account_gone(s.summary["os_user"]), s.summary
    for path, st in before.items():  # (useradd and userdel replace /etc/passwd and /etc/shadow: a new inode)
        now = os.stat(path)
        assert (now.st_uid, now.st_gid, now.st_mode) == (st.st_uid, st.st_gid, st.st_mode), path
    assert os.stat(src / "d" / "hard").st_ino == before[str(rootfile)].st_ino
    for name in ("d", "d/shadow", "d/soft", "d/mine", "d/mine2"):
        st = os.lstat(src / name)
        assert (st.st_uid, st.st_gid) == (user.uid, user.gid), name
    assert s.summary["os_user"] not in acl_names(src)


def test_an_account_whose_group_number_was_taken_is_refused_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HELD. useradd --user-group gives the account's group the uid as its gid only if that gid is free; when
    another group has it (a race with whoever made that group), useradd takes another gid of the range, the
    check after it refuses the account, and nothing of it is left: no user, no group, no record."""
    from agentcell.accounts import accounts, ephemeral

    monkeypatch.setenv("AGENTCELL_STATE_DIR", str(tmp_path / "state"))
    taken = ephemeral._free_uid()
    squatter = "ac-g" + secrets.token_hex(3)
    subprocess.run(["groupadd", "--gid", str(taken), squatter], check=True)
    try:
        monkeypatch.setattr(ephemeral, "_free_uid", lambda: taken)  # (the race, made certain)
        sid = "gid-" + secrets.token_hex(4)
        with pytest.raises(accounts.AccountError, match="not .*another account took the number"):
            ephemeral.create_ephemeral(sid)
        name = ephemeral.name_for(sid)
        assert account_gone(name)
        with pytest.raises(KeyError):
            grp.getgrnam(name)
        assert ephemeral.leftovers() == []
        assert grp.getgrgid(taken).gr_name == squatter, "the other group is left alone"
    finally:
        subprocess.run(["groupdel", squatter], capture_output=True)
