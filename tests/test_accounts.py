"""Agent accounts (issue 4): real users, groups, ACLs and cells; every test removes what it made.

The human is a throwaway account with a real 0755 home under /home; agents are ``ac-a<hex>`` with
group ``agentcell-ac-a<hex>``; the registry lives in a per-test state dir (AGENTCELL_STATE_DIR).
"""
from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentcell.accounts import Commands, accounts, acl, ephemeral
from agentcell.accounts.registry import open_registry
from conftest import AGENTCELL, User, needs_root

pytestmark = needs_root


@dataclass
class Human:
    name: str
    uid: int
    gid: int
    home: Path

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # runuser starts a new session: the groups come from /etc/group, as at the human's next login
        return subprocess.run(["runuser", "-u", self.name, "--", *argv], capture_output=True, text=True,
                              check=check, cwd="/")


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "state"
    monkeypatch.setenv("AGENTCELL_STATE_DIR", str(d))
    return d


@pytest.fixture
def human() -> Iterator[Human]:
    name = "ac-h" + secrets.token_hex(3)
    subprocess.run(["useradd", "-m", "-d", f"/home/{name}", "-s", "/bin/sh", name], check=True)
    home = Path(f"/home/{name}")
    home.chmod(0o755)  # a home others may read: the agent still must not
    pw = pwd.getpwnam(name)
    try:
        yield Human(name, pw.pw_uid, pw.pw_gid, home)
    finally:
        p = subprocess.run(["userdel", "-r", name], capture_output=True, text=True)
        assert p.returncode == 0, f"could not delete test human {name}: {p.stderr}"


def _force_remove(name: str) -> list[str]:
    """Last-resort cleanup of an agent the test left behind (a failing test); what it had to remove."""
    left = []
    try:
        uid = pwd.getpwnam(name).pw_uid
        subprocess.run(["setpriv", f"--reuid={uid}", "--regid=65534", "--clear-groups", "kill", "-KILL", "-1"],
                       capture_output=True)
        time.sleep(0.1)
        subprocess.run(["userdel", name], check=True, capture_output=True)
        left.append("user")
    except KeyError:
        pass
    if subprocess.run(["groupdel", f"agentcell-{name}"], capture_output=True).returncode == 0:
        left.append("group")
    if os.path.lexists(f"/home/{name}"):
        shutil.rmtree(f"/home/{name}")
        left.append("home")
    return left


def _remove_agents(*names: str) -> None:
    """Delete agents a test made itself (through agentcell, then by force for what is left)."""
    for n in names:
        with open_registry() as reg:
            known = n in reg.agents
        if known:
            accounts.delete(n, delete_home=True, cmds=Commands())
        _force_remove(n)


@pytest.fixture
def agent(state: Path, human: Human) -> Iterator[str]:
    name = "ac-a" + secrets.token_hex(3)
    accounts.new(name, human=human.name, cmds=Commands())
    try:
        yield name
    finally:
        with open_registry() as reg:
            known = name in reg.agents
        problems = accounts.delete(name, delete_home=True, cmds=Commands()) if known else []
        forced = _force_remove(name)
        assert not problems and not forced, (problems, forced)


def cli(*args: str, cwd: str = "/", stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "AGENTCELL_STATE_DIR": os.environ["AGENTCELL_STATE_DIR"]}
    return subprocess.run([AGENTCELL, "agent", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          stdin=stdin, timeout=60)


def run_json(*args: str, cwd: str = "/") -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    p = cli("run", "--json", *args, cwd=cwd)
    last = p.stdout.rstrip("\n").rsplit("\n", 1)[-1]
    return p, (json.loads(last) if last.startswith("{") else {})


def project(human: Human, name: str = "proj") -> Path:
    d = human.home / name
    d.mkdir()
    (d / "notes.txt").write_text("by the human\n")
    for p in (d, d / "notes.txt"):
        shutil.chown(p, human.uid, human.gid)
    return d


def acl_dump(path: Path) -> str:
    return subprocess.run(["getfacl", "-R", "-P", "-p", str(path)], capture_output=True, text=True,
                          errors="surrogateescape").stdout


def nothing_left(name: str, gid: int, *trees: Path) -> None:
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
    with pytest.raises(KeyError):
        grp.getgrnam(f"agentcell-{name}")
    for t in trees:
        assert f"agentcell-{name}" not in acl_dump(t) and f"group:{gid}:" not in acl_dump(t)
    with open_registry() as reg:
        assert name not in reg.agents


# ---- lifecycle ------------------------------------------------------------------------------------

def test_full_lifecycle_through_the_cli(state: Path, human: Human) -> None:
    name = "ac-a" + secrets.token_hex(3)
    proj = project(human)
    before = acl_dump(proj)
    try:
        p = cli("new", name, "--human", human.name, "--yes")
        assert p.returncode == 0, p.stderr
        rec_gid = grp.getgrnam(f"agentcell-{name}").gr_gid
        assert human.name in grp.getgrnam(f"agentcell-{name}").gr_mem
        home = os.stat(f"/home/{name}")
        assert oct(home.st_mode & 0o7777) == "0o2770" and home.st_gid == rec_gid
        assert pwd.getpwnam(name).pw_shell == "/usr/sbin/nologin"
        assert cli("mount", "add", "--rw", str(proj), "--agent", name).returncode == 0
        assert cli("mount", "list", "--agent", name).stdout.split() == [str(proj), "[rw]"]
        info = cli("info", name, "--json")
        assert info.returncode == 0 and json.loads(info.stdout)["healthy"], info.stdout
        p, res = run_json("--agent", name, "--", "sh", "-c",
                          "id -un; pwd; echo $HOME; echo x >> notes.txt; echo a > by-agent.txt", cwd=str(proj))
        assert p.returncode == 0 and p.stdout.split("\n")[:3] == [name, str(proj), f"/home/{name}"], p.stderr
        assert (proj / "notes.txt").read_text() == "by the human\nx\n"
        assert os.stat(proj / "by-agent.txt").st_uid == pwd.getpwnam(name).pw_uid
        (proj / "by-agent.txt").unlink()
        assert cli("mount", "remove", str(proj), "--agent", name).returncode == 0
        assert acl_dump(proj) == before  # no ACL residue: not even a mask or a default entry
        assert cli("mount", "add", "--rw", str(proj), "--agent", name).returncode == 0
        run_json("--agent", name, "--", "sh", "-c", "mkdir sub && echo a > sub/by-agent.txt", cwd=str(proj))
        listed = json.loads(cli("list", "--json").stdout)["agents"]
        assert [a["name"] for a in listed] == [name] and listed[0]["state"] == "ready"
        d = cli("delete", name, "--delete-home", "--yes")
        assert d.returncode == 0, d.stderr
        nothing_left(name, rec_gid, proj)
        assert not os.path.lexists(f"/home/{name}")
        for made in (proj / "sub", proj / "sub" / "by-agent.txt"):  # given to the human, not a dead uid
            assert (os.stat(made).st_uid, os.stat(made).st_gid) == (human.uid, human.gid)
    finally:
        _force_remove(name)


def test_files_stay_editable_by_both_sides(agent: str, human: Human) -> None:
    proj = project(human)
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    human.run("sh", "-c", f"umask 077; echo human > {proj}/h.txt; mkdir {proj}/hdir")
    p, res = run_json("--agent", agent, "--", "sh", "-c",
                      f"echo agent >> {proj}/h.txt && echo a > {proj}/hdir/a.txt && umask 077 && "
                      f"echo agent > {proj}/a.txt && echo ok")
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr
    assert (proj / "h.txt").read_text() == "human\nagent\n"
    edit = human.run("sh", "-c", f"echo human >> {proj}/a.txt && echo more >> {proj}/hdir/a.txt", check=False)
    assert edit.returncode == 0, edit.stderr
    assert (proj / "a.txt").read_text() == "agent\nhuman\n"
    # In the agent's home too (setgid + default ACL), whatever the creator's umask.
    rec_home = Path(f"/home/{agent}")
    run_json("--agent", agent, "--", "sh", "-c", f"umask 077; echo mine > {rec_home}/from-agent.txt")
    assert human.run("sh", "-c", f"echo theirs >> {rec_home}/from-agent.txt", check=False).returncode == 0


def test_read_only_share_is_not_writable(agent: str, human: Human) -> None:
    proj = project(human)
    accounts.mount_add(agent, str(proj), "ro", cmds=Commands())
    p, res = run_json("--agent", agent, "--", "sh", "-c", f"cat {proj}/notes.txt; echo x >> {proj}/notes.txt "
                      f"|| echo DENIED; touch {proj}/new || echo DENIED")
    assert p.stdout.split("\n")[:3] == ["by the human", "DENIED", "DENIED"], p.stdout + p.stderr
    assert (proj / "notes.txt").read_text() == "by the human\n" and not (proj / "new").exists()


def test_agent_sees_nothing_of_the_human_outside_its_shares(agent: str, human: Human) -> None:
    proj = project(human)
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    token = secrets.token_hex(8)
    secret = human.home / "diary.txt"
    secret.write_text(token)
    secret.chmod(0o644)
    shutil.chown(secret, human.uid, human.gid)
    tmp_file = Path(f"/tmp/ac-human-{token[:6]}")
    tmp_file.write_text(token)
    tmp_file.chmod(0o644)
    sleeper = subprocess.Popen(["setpriv", f"--reuid={human.uid}", f"--regid={human.gid}", "--init-groups", "python3",
                                "-c", "import time; time.sleep(60)", token])  # setpriv execs: its PID is the sleeper's
    try:
        p, res = run_json("--agent", agent, "--", "sh", "-c",
                          f"cat {secret} {tmp_file}; echo LS; ls -A {human.home}; echo END; cat /proc/*/cmdline; true")
        assert p.returncode == 0, p.stderr
        assert token not in p.stdout, p.stdout  # neither the file, the /tmp file nor the human's argv
        listing = p.stdout.split("LS\n", 1)[1].split("END\n", 1)[0].split()
        assert listing == ["proj"], listing  # the home exists in the cell only as the way to the share
    finally:
        sleeper.kill()
        sleeper.wait()
        tmp_file.unlink()


def test_exit_status_passes_through_without_a_terminal(agent: str) -> None:
    p = cli("run", "--agent", agent, "--", "sh", "-c", "exit 7")
    assert p.returncode == 7, p.stderr


def test_tiocsti_from_the_agent_does_not_reach_the_humans_terminal(agent: str) -> None:
    token = secrets.token_hex(8)
    code = ("import fcntl, termios, sys\nfor fd in (0, 1, 2):\n    try:\n"
            f"        [fcntl.ioctl(fd, termios.TIOCSTI, bytes([c])) for c in b'{token}\\n']\n"
            "    except OSError:\n        pass\n")
    master, slave = os.openpty()
    try:
        env = {"PATH": os.environ["PATH"], "AGENTCELL_STATE_DIR": os.environ["AGENTCELL_STATE_DIR"]}
        p = subprocess.Popen([AGENTCELL, "agent", "run", "--agent", agent, "--", "python3", "-c", code],
                             stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        out = b""
        while p.poll() is None:
            try:
                os.set_blocking(master, False)
                out += os.read(master, 4096)
            except (BlockingIOError, OSError):
                time.sleep(0.02)
        assert p.returncode == 0, out
        os.set_blocking(slave, False)
        try:
            pending = os.read(slave, 4096)
        except BlockingIOError:
            pending = b""
        assert token.encode() not in pending  # nothing waits in the human's terminal input
    finally:
        os.close(master)
        os.close(slave)


# ---- paths: resolved once, re-checked at each run, never followed ----------------------------------

def test_a_swapped_share_is_refused_at_run(agent: str, human: Human) -> None:
    proj = project(human)
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    moved = human.home / "proj.real"
    proj.rename(moved)
    os.symlink("/etc/pam.d", proj)  # au followed exactly this
    os.lchown(proj, human.uid, human.gid)
    p = cli("run", "--agent", agent, "--", "true")
    assert p.returncode == 125 and "symlink" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    proj.unlink()
    proj.mkdir()  # a different directory under the same name
    p = cli("run", "--agent", agent, "--", "true")
    assert p.returncode == 125 and "replaced" in p.stderr, p.stderr
    info = cli("info", agent)
    assert info.returncode == 1 and "FAIL share" in info.stdout
    proj.rmdir()
    moved.rename(proj)
    assert cli("run", "--agent", agent, "--", "true").returncode == 0


def test_sharing_never_follows_a_symlink_inside_the_share(agent: str, human: Human, tmp_path: Path) -> None:
    proj = project(human)
    outside = tmp_path / "root-only"
    outside.mkdir(mode=0o700)
    (outside / "key").write_text("k")
    before = acl_dump(outside)
    os.symlink(outside, proj / "link-dir")
    os.symlink(outside / "key", proj / "link-file")
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    assert acl_dump(outside) == before
    accounts.mount_remove(agent, str(proj), cmds=Commands())
    assert acl_dump(outside) == before


def test_a_symlinked_source_made_by_a_user_is_refused(agent: str, human: Human) -> None:
    proj = project(human)
    link = human.home / "via-link"
    os.symlink(proj, link)
    os.lchown(link, human.uid, human.gid)
    p = cli("mount", "add", "--rw", str(link), "--agent", agent)
    assert p.returncode == 125 and "symlink" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert acl.residue(pwd.getpwnam(agent).pw_uid, grp.getgrnam(f"agentcell-{agent}").gr_gid, str(proj)) == []


def test_sharing_keeps_acls_the_tree_already_had(agent: str, human: Human) -> None:
    proj = project(human)
    subprocess.run(["setfacl", "-m", f"u:{human.name}:rw,m::rw", str(proj / "notes.txt")], check=True)
    subprocess.run(["setfacl", "-m", "d:o::r", str(proj)], check=True)
    before = acl_dump(proj)
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    assert acl_dump(proj) != before
    accounts.mount_remove(agent, str(proj), cmds=Commands())
    assert acl_dump(proj) == before


# ---- what a red-team pass found (each test fails on the path-based first version) ------------------

def _as(uid: int, gid: int, *argv: str) -> None:
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", *argv], check=True,
                   capture_output=True)


def test_a_prior_acl_is_never_restored_through_a_swapped_parent(agent: str, human: Human, tmp_path: Path) -> None:
    # The agent gives a file of its own an ACL, gets it recorded as "prior" by a re-share, then swaps
    # its parent for a symlink to a root-only directory: root must not write that ACL there.
    proj = project(human)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "shadow").write_text("root's\n")
    (victim / "shadow").chmod(0o600)
    before = acl_dump(victim), oct((victim / "shadow").stat().st_mode)
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    uid = pwd.getpwnam(agent).pw_uid
    run_json("--agent", agent, "--", "sh", "-c", f"cd {proj} && mkdir a && echo x > a/shadow && chmod 666 a/shadow "
             f"&& setfacl -m u:{human.uid}:rw a/shadow")
    accounts.mount_remove(agent, str(proj), cmds=Commands())
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    run_json("--agent", agent, "--", "sh", "-c", f"cd {proj} && mv a a.old && ln -s {victim} a")
    accounts.mount_remove(agent, str(proj), cmds=Commands())
    assert (acl_dump(victim), oct((victim / "shadow").stat().st_mode)) == before
    assert uid not in acl.residue(uid, uid, str(proj))


def test_delete_strips_the_agents_own_acl_entries_and_never_reuses_its_uid(state: Path, human: Human) -> None:
    name, later = "ac-a" + secrets.token_hex(3), "ac-a" + secrets.token_hex(3)
    proj = project(human)
    try:
        rec = accounts.new(name, human=human.name, cmds=Commands())
        accounts.mount_add(name, str(proj), "rw", cmds=Commands())
        run_json("--agent", name, "--", "sh", "-c", f"cd {proj} && mkdir tools && setfacl -m "
                 f"u:{rec.uid}:rwx,d:u:{rec.uid}:rwx tools && echo x > ~/kept.txt")
        assert not accounts.delete(name, delete_home=False, cmds=Commands())
        assert f"user:{rec.uid}:" not in acl_dump(proj) and f"group:{rec.gid}:" not in acl_dump(proj)
        home = Path(f"/home/{name}")
        assert f":{rec.gid}:" not in acl_dump(home)  # the kept home: no entry for a number that is free now
        assert {(p.stat().st_uid, p.stat().st_gid) for p in [home, *home.iterdir()]} == {(human.uid, human.gid)}
        shutil.rmtree(home)
        nxt = accounts.new(later, human=human.name, cmds=Commands())
        assert nxt.uid > rec.uid
    finally:
        _remove_agents(name, later)


def test_deep_and_long_trees_neither_crash_nor_keep_the_uid(agent: str, human: Human) -> None:
    proj = project(human)
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    # 1200 levels (Python's recursion limit is 1000) of 40-character names: ~50,000 bytes, past PATH_MAX.
    script = ("import os\nos.chdir(os.environ['P'])\nfor i in range(1200):\n    os.mkdir('d' * 40)\n"
              "    os.chdir('d' * 40)\nopen('leaf', 'w').write('x')\n")
    p = cli("run", "--agent", agent, "--env", f"P={proj}", "--", "python3", "-c", script)
    assert p.returncode == 0, p.stderr
    uid = pwd.getpwnam(agent).pw_uid
    gid = grp.getgrnam(f"agentcell-{agent}").gr_gid
    assert acl.owned_by(uid, gid, str(proj))  # the agent's tree, before
    d = cli("delete", agent, "--delete-home", "--yes")
    assert d.returncode == 0 and "Traceback" not in d.stderr, d.stderr
    assert acl.owned_by(uid, gid, str(proj)) == [] and acl.residue(uid, gid, str(proj)) == []
    subprocess.run(["rm", "-rf", str(proj)], check=True)


def test_odd_names_and_a_failing_grant_leave_nothing(agent: str, human: Human) -> None:
    proj = project(human)
    odd = os.fsencode(str(proj)) + b"/bad\xff"
    with open(odd, "w") as f:
        f.write("x")
    subprocess.run([b"setfacl", b"-m", f"u:{human.uid}:r".encode(), odd], check=True)
    before = acl_dump(proj)
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    accounts.mount_remove(agent, str(proj), cmds=Commands())
    assert acl_dump(proj) == before
    # A file whose ACL is full (as an agent could leave it): the grant fails half way and is undone.
    full = proj / "full"
    full.write_text("x")
    n = 0
    while subprocess.run(["setfacl", "-m", f"u:{2_000_000 + n}:r", str(full)], capture_output=True).returncode == 0:
        n += 1  # until the file system has no room for one more entry (ext4: ~500)
        if n > 5000:
            pytest.skip(f"the file system of {proj} takes over 5000 ACL entries: no grant can be made to fail")
    before = acl_dump(proj)
    with pytest.raises(accounts.AccountError, match="undone"):
        accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    assert acl_dump(proj) == before
    with open_registry() as reg:
        assert reg.agents[agent].shares == []


def test_revoke_only_removes_and_keeps_what_others_changed(state: Path, human: Human) -> None:
    # Two agents share one folder; meanwhile the human takes a file private (setfacl -x, chmod 600).
    # Revoking one agent must leave the other's entries and the human's changes as they are, and
    # never write back a recorded ACL (a recorded inode can be a new file by now).
    a, b = "ac-a" + secrets.token_hex(3), "ac-a" + secrets.token_hex(3)
    proj = project(human)
    secret = proj / "secret.txt"
    secret.write_text("s\n")
    shutil.chown(secret, human.uid, human.gid)
    subprocess.run(["setfacl", "-m", "u:nobody:r", str(secret)], check=True)
    original = acl_dump(proj)
    try:
        ra = accounts.new(a, human=human.name, cmds=Commands())
        rb = accounts.new(b, human=human.name, cmds=Commands())
        accounts.mount_add(a, str(proj), "rw", cmds=Commands())
        accounts.mount_add(b, str(proj), "rw", cmds=Commands())
        subprocess.run(["setfacl", "-x", "u:nobody", str(secret)], check=True)
        secret.chmod(0o600)
        accounts.mount_remove(a, str(proj), cmds=Commands())
        dump = acl_dump(proj)
        assert f"agentcell-{a}" not in dump and f"group:agentcell-{b}:" in dump
        accounts.mount_remove(b, str(proj), cmds=Commands())
        assert oct(secret.stat().st_mode & 0o777) == "0o600"  # the human's chmod stands
        assert "nobody" not in acl_dump(secret)  # and their setfacl -x too
        secret.chmod(0o644)
        subprocess.run(["setfacl", "-m", "u:nobody:r", str(secret)], check=True)
        assert acl_dump(proj) == original
        assert acl.residue(ra.uid, ra.gid, str(proj)) == acl.residue(rb.uid, rb.gid, str(proj)) == []
    finally:
        _remove_agents(a, b)


def test_files_handed_to_the_human_lose_what_the_agent_opened_up(agent: str, human: Human) -> None:
    proj = project(human)
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    p = cli("run", "--agent", agent, "--", "sh", "-c",
            f"cd {proj} && mkdir pub && chmod 2777 pub && setfacl -m u:nobody:rwx,d:o::rwx pub && "
            "echo x > pub/run.sh && chmod 2777 pub/run.sh && setfacl -m u:nobody:rw pub/run.sh")
    assert p.returncode == 0, p.stderr
    assert cli("delete", agent, "--delete-home", "--yes").returncode == 0
    for f in (proj / "pub", proj / "pub" / "run.sh"):
        st = f.stat()
        assert (st.st_uid, st.st_gid) == (human.uid, human.gid)
        assert not st.st_mode & (0o4000 | 0o2000 | 0o002), oct(st.st_mode)
        assert "nobody" not in acl_dump(f) and "default:other::rwx" not in acl_dump(f)


def test_a_walk_cut_short_by_the_fd_limit_is_not_reported_clean(agent: str, human: Human) -> None:
    proj = project(human)
    accounts.mount_add(agent, str(proj), "rw", cmds=Commands())
    script = ("import os\nos.chdir(os.environ['P'])\nfor i in range(400):\n    os.mkdir('d')\n    os.chdir('d')\n"
              "open('leaf', 'w').write('x')\n")
    assert cli("run", "--agent", agent, "--env", f"P={proj}", "--", "python3", "-c", script).returncode == 0
    env = {"PATH": os.environ["PATH"], "AGENTCELL_STATE_DIR": os.environ["AGENTCELL_STATE_DIR"]}
    p = subprocess.run(["prlimit", "--nofile=256:256", AGENTCELL, "agent", "mount", "remove", str(proj), "--agent",
                        agent], capture_output=True, text=True, env=env)
    assert p.returncode == 125 and "not walked" in p.stderr, p.stderr
    assert accounts.mount_remove(agent, str(proj), cmds=Commands())  # with the usual limit: done


def test_session_account_files_go_to_the_human(state: Path, human: Human, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    acct = ephemeral.create_ephemeral("files-" + secrets.token_hex(4))
    try:
        work.chmod(0o777)
        p = subprocess.run([AGENTCELL, "run", "--no-warm", "--as", str(acct.uid), "--rw", str(work), "--", "sh", "-c",
                            f"echo hi > {work}/f && chmod 2755 {work}/f"], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        with pytest.raises(accounts.AccountError, match="still owned"):
            ephemeral.delete(acct, paths=[str(work)])
    finally:
        ephemeral.delete(acct, paths=[str(work)], give_to=(human.uid, human.gid))
    st = (work / "f").stat()
    assert (st.st_uid, st.st_gid) == (human.uid, human.gid) and not st.st_mode & 0o6000


def test_a_file_the_revokes_walk_missed_is_found_and_given_at_delete(state: Path, human: Human, tmp_path: Path) -> None:
    """A session's cleanup gives the account's files back in its revoke's walk and tells delete so
    (given=True): delete walks once more only to check, and gives what is still the account's (made or
    moved behind that walk); the account's record, user and group go."""
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)
    acct = ephemeral.create_ephemeral("given-" + secrets.token_hex(4))
    try:
        assert acl.revoke(Commands(), acct.uid, acct.gid, str(work), [], give_to=(human.uid, human.gid)) == []
        p = subprocess.run([AGENTCELL, "run", "--no-warm", "--as", str(acct.uid), "--rw", str(work), "--", "sh", "-c",
                            f"mkdir {work}/late && echo hi > {work}/late/f"], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr  # (behind the walk, as a concurrent rename would hide them from it)
    finally:
        ephemeral.delete(acct, paths=[str(work)], give_to=(human.uid, human.gid), given=True)
    for made in (work / "late", work / "late" / "f"):
        assert (made.stat().st_uid, made.stat().st_gid) == (human.uid, human.gid), made
    assert acl.owned_by(acct.uid, acct.gid, str(work)) == [] and ephemeral.leftovers() == []


# ---- delete from any partial state ----------------------------------------------------------------

class FailAfter(Commands):
    """Real commands that stop with an error after the first ``n``: a crash at that step (test only)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def run(self, argv, *, check=True, step=""):  # type: ignore[no-untyped-def]
        if len(self.log) >= self.n:
            raise accounts.AccountError(step or argv[0], "simulated crash")
        return super().run(argv, check=check, step=step)


@pytest.mark.parametrize("crash_after", [1, 2, 3, 4])
def test_delete_cleans_a_half_made_agent(state: Path, human: Human, crash_after: int) -> None:
    name = "ac-a" + secrets.token_hex(3)
    try:
        with pytest.raises(accounts.AccountError, match="simulated crash"):
            accounts.new(name, human=human.name, cmds=FailAfter(crash_after))
        with open_registry() as reg:
            assert reg.agents[name].state == "creating"
        assert "not ready" in cli("run", "--agent", name, "--", "true").stderr
        d = cli("delete", name, "--delete-home", "--yes")
        assert d.returncode == 0, d.stderr
        nothing_left(name, -1)
        assert not os.path.lexists(f"/home/{name}")
    finally:
        _force_remove(name)


@pytest.mark.parametrize("damage", ["user_gone", "group_gone", "home_gone", "stray_process", "share_gone"])
def test_delete_after_damage_leaves_nothing(state: Path, human: Human, damage: str) -> None:
    name = "ac-a" + secrets.token_hex(3)
    proj = project(human)
    before = acl_dump(proj)
    try:
        rec = accounts.new(name, human=human.name, cmds=Commands())
        accounts.mount_add(name, str(proj), "rw", cmds=Commands())
        stray = None
        if damage == "user_gone":
            subprocess.run(["userdel", name], check=True)
        elif damage == "group_gone":
            subprocess.run(["gpasswd", "-d", human.name, rec.group], check=True, capture_output=True)
            subprocess.run(["usermod", "-g", "users", name], check=True)
            subprocess.run(["groupdel", rec.group], check=True)
        elif damage == "home_gone":
            shutil.rmtree(rec.home)
        elif damage == "stray_process":  # outside any cell, in its own session: what au's delete missed
            stray = subprocess.Popen(["setpriv", f"--reuid={rec.uid}", f"--regid={rec.gid}", "--clear-groups",
                                      "setsid", "sleep", "300"])
            time.sleep(0.2)
            assert accounts.processes(rec.uid)
            assert cli("info", name).returncode == 1
        elif damage == "share_gone":
            shutil.rmtree(proj)
        d = cli("delete", name, "--delete-home", "--yes")
        assert d.returncode == 0, d.stderr
        nothing_left(name, rec.gid, *([proj] if proj.exists() else []))
        if proj.exists():
            assert acl_dump(proj) == before
        assert not accounts.processes(rec.uid)
        if stray is not None:
            assert stray.wait(5) == -9
    finally:
        _force_remove(name)


def test_delete_is_honest_about_what_it_cannot_remove(agent: str, human: Human) -> None:
    # A user of the same name re-created with another uid is not the agent's: left alone, and said so.
    uid = pwd.getpwnam(agent).pw_uid
    subprocess.run(["userdel", agent], check=True)
    subprocess.run(["useradd", "-M", "-N", "-g", "users", "-s", "/usr/sbin/nologin", "-u", str(uid + 1000), agent],
                   check=True)
    try:
        d = cli("delete", agent, "--yes")
        assert d.returncode == 1 and "left alone" in d.stderr, d.stderr
        with open_registry() as reg:
            assert reg.agents[agent].state == "deleting"
    finally:
        subprocess.run(["userdel", agent], check=True)


# ---- input, transparency -------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "field"), [
    (["new", "Bad Name", "--yes", "--human", "root"], "NAME"),
    (["new", "x" * 30, "--yes", "--human", "root"], "NAME"),
    (["new", "ok", "--yes", "--human", "root"], "--human"),
    (["new", "ok", "--yes", "--human", "nosuchuser-ac"], "--human"),
    (["new", "root", "--yes", "--human", "nobody"], "NAME"),
    (["mount", "add", "/nonexistent-ac", "--agent", "nosuch-ac"], "agent"),
    (["run", "--agent", "nosuch-ac", "--", "true"], "agent"),
    (["info", "nosuch-ac"], "agent"),
])
def test_bad_input_is_one_line(state: Path, args: list[str], field: str) -> None:
    p = cli(*args)
    assert p.returncode == 125 and p.stderr.count("\n") == 1 and f": {field}: " in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(("path", "why"), [("/", "whole host"), ("/nonexistent-ac", "does not exist"),
                                           ("/etc", "system directory")])
def test_bad_share_paths_are_one_line(agent: str, path: str, why: str) -> None:
    p = cli("mount", "add", "--rw", path, "--agent", agent)
    assert p.returncode == 125 and why in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_dry_run_prints_every_command_and_changes_nothing(state: Path, human: Human) -> None:
    name = "ac-a" + secrets.token_hex(3)
    p = cli("new", name, "--human", human.name, "--dry-run")
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("+ ")]
    assert [line.split()[1] for line in lines] == ["groupadd", "useradd", "install", "setfacl", "gpasswd"]
    assert f"+ gpasswd --add {human.name} agentcell-{name}" in lines
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
    assert not (state / "agents.toml").exists()


def test_an_existing_account_is_never_taken_over(state: Path, human: Human) -> None:
    p = cli("new", human.name, "--human", human.name, "--yes")
    assert p.returncode == 125 and "not an agentcell agent" in p.stderr
    assert pwd.getpwnam(human.name).pw_uid == human.uid


def test_delete_without_a_terminal_asks_for_yes(agent: str) -> None:
    p = cli("delete", agent)
    assert p.returncode == 125 and "--yes" in p.stderr
    assert pwd.getpwnam(agent)


# ---- ephemeral accounts ---------------------------------------------------------------------------

def test_ephemeral_account_lifecycle(state: Path, tmp_path: Path) -> None:
    session = "session-" + secrets.token_hex(4)
    acct = ephemeral.create_ephemeral(session)
    try:
        assert ephemeral.UID_FIRST <= acct.uid <= ephemeral.UID_LAST
        assert pwd.getpwnam(acct.name).pw_uid == acct.uid and grp.getgrgid(acct.uid).gr_name == acct.name
        assert [a.name for a in ephemeral.leftovers()] == [acct.name]
        with pytest.raises(accounts.AccountError, match="already has an account"):
            ephemeral.create_ephemeral(session)
        p = subprocess.run([AGENTCELL, "run", "--no-warm", "--as", str(acct.uid), "--", "id", "-u"],
                           capture_output=True, text=True)
        assert p.stdout.strip() == str(acct.uid), p.stderr
    finally:
        ephemeral.delete(acct)
    with pytest.raises(KeyError):
        pwd.getpwnam(acct.name)
    with pytest.raises(KeyError):
        grp.getgrnam(acct.name)
    assert ephemeral.leftovers() == []


def test_cells_launch_while_accounts_come_and_go(user: User, tmp_path: Path) -> None:
    # useradd/userdel replace /etc/shadow and /etc/gshadow by a rename: a cell built meanwhile must
    # mask the file found there, not fail (per-session accounts are made while other cells start).
    name = "ac-churn" + secrets.token_hex(2)
    flag = tmp_path / "churning"
    flag.touch()
    # The loop ends itself once the flag is gone, after its last userdel: nothing is left mid-way.
    churn = subprocess.Popen(["sh", "-c", f"while [ -e {flag} ]; do useradd -M {name}; userdel {name}; done"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        codes = [subprocess.run([AGENTCELL, "run", "--no-warm", "--as", str(user.uid), "--", "true"],
                                capture_output=True, text=True) for _ in range(15)]
    finally:
        flag.unlink()
        churn.wait(30)
        subprocess.run(["userdel", name], capture_output=True)
    assert [c.returncode for c in codes] == [0] * 15, [c.stderr for c in codes if c.returncode]


@needs_root
def test_a_group_held_by_one_thread_only_is_seen_as_held() -> None:
    """Each thread has credentials of its own: a raw setresgid changes only its caller's. A process whose
    leader has its own group while another thread holds a session account's is a holder all the same."""
    gid = ephemeral.UID_FIRST + secrets.randbelow(ephemeral.UID_LAST - ephemeral.UID_FIRST + 1)
    code = ("import ctypes, sys, threading, time\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "def hold():\n"
            f"    assert libc.syscall(119, {gid}, {gid}, {gid}) == 0, ctypes.get_errno()  # setresgid, this thread\n"
            "    print('held', flush=True)\n"
            "    time.sleep(60)\n"
            "threading.Thread(target=hold, daemon=True).start()\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "held\n"
        with open(f"/proc/{p.pid}/status") as f:
            assert str(gid) not in next(line for line in f if line.startswith("Gid:")).split()  # (the leader's)
        assert p.pid in [pid for pid, _ in accounts.held_ids()[1].get(gid, [])]
        assert any(f"process {p.pid} " in line for line in accounts.group_holders(gid, gid))
        assert not any(f"process {p.pid} " in line for line in accounts.group_holders(0, gid))  # (the agent's own)
    finally:
        p.kill()
        p.wait()
