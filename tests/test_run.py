"""`agentcell run` against the real kernel: what the cell lets through and what it stops."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import AGENTCELL, User, agentcell_run, deny_syscall, needs_root
from terminal import TIOCSTI_ATTACK, OnTerminal, read_until

pytestmark = needs_root


def as_uid(user: User) -> list[str]:
    return ["--as", str(user.uid)]


def test_write_inside_rw_lands_and_writes_elsewhere_fail(user: User, project: Path) -> None:
    marker = f"agentcell-marker-{os.getpid()}"
    script = textwrap.dedent(f"""
        echo made > {project}/new.txt
        for p in /usr/{marker} /etc/{marker} /{marker} /opt/{marker} /home/{marker}; do
          if echo x > $p 2>/dev/null; then echo "WROTE $p"; fi
        done
        echo x > /tmp/{marker}
    """)
    r = agentcell_run([*as_uid(user), "--rw", str(project), "--", "sh", "-c", script])
    assert r.rc == 0, r.err
    assert "WROTE" not in r.out
    assert (project / "new.txt").read_text() == "made\n"
    assert (project / "new.txt").stat().st_uid == user.uid
    for p in ("/usr", "/etc", "/", "/opt", "/tmp"):
        assert not os.path.exists(os.path.join(p, marker)), f"cell write reached host {p}"


def test_write_outside_fails_with_erofs_or_eacces(user: User, project: Path) -> None:
    code = "import errno,sys\ntry:\n open('/usr/x','w')\nexcept OSError as e:\n print(errno.errorcode[e.errno])"
    r = agentcell_run([*as_uid(user), "--rw", str(project), "--", "python3", "-c", code])
    assert r.out.strip() in ("EROFS", "EACCES"), r.out + r.err


def test_ro_path_is_read_only_and_nosuid(user: User, project: Path, tmp_path: Path) -> None:
    vault = Path("/tmp") / f"agentcell-vault-{os.getpid()}"
    vault.mkdir()
    try:
        suid_id = vault / "id"
        shutil.copy2("/usr/bin/id", suid_id)
        os.chmod(suid_id, 0o4755)  # setuid root: outside a nosuid mount it would give euid 0
        (vault / "data").write_text("secret-ish\n")
        r = agentcell_run([*as_uid(user), "--vault-ro", str(vault), "--rw", str(project), "--", "sh", "-c",
                           f"{suid_id} -u; cat {vault}/data; echo x > {vault}/data && echo WROTE; "
                           "grep -v nosuid /proc/self/mountinfo | grep -v ' /dev/' || true"])
        assert r.rc == 0, r.err
        lines = r.out.splitlines()
        assert lines[0] == str(user.uid), "a setuid binary on an --ro path gained privilege"
        assert "secret-ish" in r.out
        assert "WROTE" not in r.out
        assert len(lines) == 2, f"mounts without nosuid inside the cell: {lines[2:]}"
    finally:
        shutil.rmtree(vault)


def test_host_home_root_and_shadow_are_invisible(user: User, project: Path) -> None:
    r = agentcell_run([*as_uid(user), "--rw", str(project), "--", "sh", "-c",
                       "ls -A /home; test -e /root && echo ROOT; cat /etc/shadow /etc/gshadow 2>/dev/null;"
                       "stat -c %s /etc/shadow; test -e /run && echo RUN; echo $HOME"])
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert lines[0] == user.name  # only the cell's own (tmpfs) home
    assert "ROOT" not in lines and "RUN" not in lines
    assert ":" not in r.out  # no shadow line was readable
    assert lines[-2] == "0"
    assert lines[-1] == f"/home/{user.name}"


def test_host_processes_and_pid1_are_invisible(user: User, project: Path) -> None:
    r = agentcell_run([*as_uid(user), "--", "sh", "-c",
                       "ls /proc | grep -E '^[0-9]+$' | sort -n | tr '\\n' ' '; echo; "
                       "cat /proc/1/environ 2>/dev/null && echo LEAK; true"])
    assert r.rc == 0, r.err
    pids = [int(x) for x in r.out.split("\n")[0].split()]
    assert 1 not in pids, "the cell's PID 1 (root, holds the supervisor's environment) is visible"
    assert max(pids) < 20, f"host processes visible: {pids}"  # only this pipeline lives here
    assert "LEAK" not in r.out


def test_environment_is_scrubbed(user: User) -> None:
    r = agentcell_run([*as_uid(user), "--env", "GIVEN=1", "--keep-env", "KEPT", "--", "env"],
                      env={"OPENAI_API_KEY": "sk-secret", "AWS_SECRET_ACCESS_KEY": "x", "KEPT": "k", "TERM": "xterm"})
    assert r.rc == 0, r.err
    env = dict(line.split("=", 1) for line in r.out.splitlines())
    assert "OPENAI_API_KEY" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["GIVEN"] == "1" and env["KEPT"] == "k" and env["TERM"] == "xterm"
    assert set(env) <= {"PATH", "LANG", "TERM", "HOME", "USER", "GIVEN", "KEPT", "PWD", "SHLVL", "_"} | {
        k for k in env if k.startswith("LC_")}


def test_fd_opened_outside_is_not_inherited(user: User) -> None:
    r_fd, w_fd = os.pipe()
    os.set_inheritable(w_fd, True)
    try:
        r = agentcell_run([*as_uid(user), "--", "python3", "-c",
                           "import os; print(sorted(int(x) for x in os.listdir('/proc/self/fd')))"],
                          pass_fds=(w_fd,))
    finally:
        os.close(r_fd)
        os.close(w_fd)
    assert r.rc == 0, r.err
    assert r.out.strip() == "[0, 1, 2, 3]"  # 3 is listdir's own directory fd


def test_exit_status_and_signal_pass_through(user: User) -> None:
    r = agentcell_run([*as_uid(user), "--", "sh", "-c", "exit 7"])
    assert r.rc == 7 and r.result["exit_status"] == 7 and r.result["signal"] == 0
    r = agentcell_run([*as_uid(user), "--", "sh", "-c", "kill -TERM $$"])
    assert r.rc == 128 + 15 and r.result["signal"] == 15


def test_background_process_is_killed_when_the_cell_ends(user: User) -> None:
    tag = f"{os.getpid() % 1000}.{len(str(user.uid))}7"
    r = agentcell_run([*as_uid(user), "--", "sh", "-c", f"setsid sleep {tag} >/dev/null 2>&1 & exit 0"])
    assert r.rc == 0, r.err
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd[:2] == [b"sleep", tag.encode()]:
            left.append(pid)
    assert not left, f"processes outlived the cell: {left}"


def test_timeout_kills_the_cell(user: User) -> None:
    r = agentcell_run([*as_uid(user), "--timeout", "0.5", "--", "sleep", "30"])
    assert r.rc == 124 and r.result["timed_out"] is True


def test_command_not_found_is_127(user: User) -> None:
    r = agentcell_run([*as_uid(user), "--", "no-such-command-agentcell"])
    assert r.rc == 127
    assert "command not found" in r.err and "Traceback" not in r.err


def test_mask_hides_a_file_inside_a_rw_path(user: User, project: Path) -> None:
    (project / ".env").write_text("API_KEY=hunter2\n")
    r = agentcell_run([*as_uid(user), "--rw", str(project), "--mask", str(project / ".env"), "--", "sh", "-c",
                       f"cat {project}/.env; echo rc=$?; echo x > {project}/.env; echo rc=$?"])
    assert "hunter2" not in r.out
    assert "rc=0" not in r.out
    assert (project / ".env").read_text() == "API_KEY=hunter2\n"


def test_root_without_an_account_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUDO_")}
    p = subprocess.run([AGENTCELL, "run", "--", "true"], capture_output=True, text=True, env=env)
    assert p.returncode == 125
    assert "--as" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_sudo_uid_is_the_default_identity(user: User) -> None:
    r = agentcell_run(["--", "id", "-u"], env={"SUDO_UID": str(user.uid), "SUDO_GID": str(user.gid)})
    assert r.rc == 0, r.err
    assert r.out.strip() == str(user.uid)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--rw", "/nonexistent-agentcell"], "--rw"),
        (["--rw", "/"], "--rw"),
        (["--rw", "/usr"], "--rw"),
        (["--ro", "/root"], "--ro"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--env", "NOEQUALS"], "--env"),
        (["--env", "1BAD=x"], "--env"),
        (["--as", "agent:no-such-agentcell-user"], "--as"),
        (["--as", "0"], "--as"),
        (["--timeout", "-1"], "--timeout"),
        (["--net", "wifi"], "--net"),
    ],
)
def test_bad_input_gives_one_line_and_nonzero_exit(user: User, args: list[str], needle: str) -> None:
    p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), *args, "--", "true"],
                       capture_output=True, text=True)
    assert p.returncode == 125, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr


def test_credential_dir_is_refused_unless_overridden(user: User, tmp_path: Path) -> None:
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), "--ro", str(ssh), "--", "true"],
                       capture_output=True, text=True)
    assert p.returncode == 125 and "credential" in p.stderr
    r = agentcell_run([*as_uid(user), "--ro", str(ssh), "--allow-unsafe-path", "--", "true"])
    assert r.rc == 0, r.err


def test_explain_runs_nothing_and_lists_the_steps(user: User, project: Path) -> None:
    p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), "--rw", str(project), "--explain", "--",
                        "touch", str(project / "should-not-exist")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert not (project / "should-not-exist").exists()
    for needle in ("pivot_root", "bind rw,nosuid,nodev " + str(project), "bind ro,nosuid,nodev /usr",
                   "PR_SET_NO_NEW_PRIVS", "mask /etc/shadow", f"{project}: all but device nodes"):
        assert needle in p.stdout, needle


def test_scratch_and_home_dirs_back_the_cell(user: User, project: Path) -> None:
    scratch, home = project / "scratch", project / "home"
    for d in (scratch, home):
        d.mkdir()
        shutil.chown(d, user.uid, user.gid)
    r = agentcell_run([*as_uid(user), "--scratch", str(scratch), "--home", str(home), "--", "sh", "-c",
                       "echo s > /scratch/f && echo h > $HOME/f"])
    assert r.rc == 0, r.err
    assert (scratch / "f").read_text() == "s\n" and (home / "f").read_text() == "h\n"


def test_stdin_from_a_file_works(user: User) -> None:
    r = agentcell_run([*as_uid(user), "--", "cat"], input="piped input\n")
    assert r.rc == 0 and r.out == "piped input"


def test_interactive_shell_has_job_control_on_its_own_terminal(user: User) -> None:
    argv = [AGENTCELL, "run", "--no-warm", "--as", str(user.uid), "--", "bash", "--norc", "--noprofile", "-i"]
    with OnTerminal(argv) as term:
        out = read_until(term.fd, b"$ ")  # type like a person: after the prompt
        os.write(term.fd, b"echo FLAGS=$-; tty; sleep 0.1 & jobs; exit 3\n")
        out += read_until(term.fd, b"\x00never")
        term.wait()
        status = term.status
    text = out.decode(errors="replace")
    assert "no job control" not in text, text
    flags = [ln for ln in text.splitlines() if ln.startswith("FLAGS=")]
    assert flags and "m" in flags[-1].split("=", 1)[1], text
    assert "/dev/pts/0" in text and "not a tty" not in text, text  # its terminal is the cell's own pty
    assert os.waitstatus_to_exitcode(status) == 3


@pytest.mark.parametrize("stdin", ["</dev/null", ""], ids=["non-interactive", "interactive"])
def test_a_cell_cannot_type_into_the_callers_terminal(user: User, stdin: str) -> None:
    # A root shell runs agentcell, then reads a line from its terminal: whatever the cell pushed into
    # that terminal would run as root.
    script = (f"{AGENTCELL} run --no-warm --as {user.uid} -- python3 -c '{TIOCSTI_ATTACK}' {stdin}; "
              "IFS= read -r -t 2 line; echo \"SHELL-READ:[$line]\"")
    with OnTerminal(["/bin/bash", "--norc", "-c", script]) as term:
        out = read_until(term.fd, b"SHELL-READ:")
        out += read_until(term.fd, b"]")
        term.wait()
    assert "SHELL-READ:[]" in out.decode(errors="replace"), out


def test_tmp_and_shm_are_private_and_writable(user: User) -> None:
    r = agentcell_run([*as_uid(user), "--", "sh", "-c", "echo a > /tmp/a && echo b > /dev/shm/b && ls -A /tmp"])
    assert r.rc == 0, r.err
    assert r.out.strip() == "a"


def test_no_capabilities_and_no_new_privs(user: User) -> None:
    r = agentcell_run([*as_uid(user), "--", "grep", "-E", "^(CapEff|CapBnd|CapAmb|NoNewPrivs)", "/proc/self/status"])
    assert r.rc == 0, r.err
    fields = dict(line.split(":\t") for line in r.out.splitlines())
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0 and int(fields["CapAmb"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"


def test_device_nodes_are_minimal(user: User) -> None:
    r = agentcell_run([*as_uid(user), "--", "sh", "-c", "ls /dev | tr '\\n' ' '; echo ok > /dev/null"])
    assert r.rc == 0, r.err
    names = set(r.out.split())
    assert {"null", "zero", "urandom", "pts", "ptmx", "shm"} <= names
    assert not {n for n in names if n.startswith(("sd", "vd", "nvme", "mem", "kmsg", "port"))}


def test_symlink_inside_project_cannot_reach_host_files(user: User, project: Path) -> None:
    secret = Path(f"/tmp/agentcell-hostsecret-{os.getpid()}")
    secret.write_text("host-only\n")
    os.chmod(secret, 0o644)
    try:
        (project / "link").symlink_to(secret)
        r = agentcell_run([*as_uid(user), "--rw", str(project), "--", "sh", "-c", f"cat {project}/link"])
        assert "host-only" not in r.out
    finally:
        secret.unlink()


def test_run_path_imports_nothing_heavy() -> None:
    # Each of these costs milliseconds on every `agentcell run` (re alone ~10 ms here): the hot path
    # parses arguments, resolves the policy and launches with the standard library's cheap parts.
    code = ("import sys; sys.argv = ['agentcell', 'run', '--as', '65534', '--', 'true']\n"
            "import agentcell.cli.main, agentcell.cli.run, agentcell.cell.launch, agentcell.host.warm\n"
            "import agentcell.supervise, agentcell.protect.check  # the cold path's protocol and protected-path step\n"
            "bad = ('pydantic', 'langgraph', 'rich', 'pyroute2', 're', 'typing', 'dataclasses', 'json', 'enum',"
            " 'socket', 'argparse', 'uuid', 'inspect', 'array', 'collections', 'threading', 'mcp', 'langchain_core',"
            " 'anyio', 'ray')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in bad))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr
    # Through a warm launcher, agentcell run does not even need the launcher's own modules.
    code = ("import sys; import agentcell.cli.main, agentcell.cli.run, agentcell.host.warm, agentcell.protect.check\n"
            "print(sorted(m for m in sys.modules if m in ('ctypes', 'importlib', 'agentcell.cell.launch',"
            " 'agentcell.cell.mounts', 'agentcell.supervise')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr


def test_is_executable() -> None:
    assert os.stat(AGENTCELL).st_mode & stat.S_IXUSR


def test_symlink_planted_in_a_project_is_not_followed_by_a_later_declaration(user: User, project: Path) -> None:
    victim = Path(f"/tmp/agentcell-victim-{os.getpid()}")
    victim.mkdir()
    try:
        r = agentcell_run([*as_uid(user), "--rw", str(project), "--", "ln", "-s", str(victim), f"{project}/build"])
        assert r.rc == 0, r.err
        # A harness that later shares "the project's build dir" must not be sent to the victim.
        p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), "--rw", str(project), "--rw",
                            f"{project}/build", "--", "true"], capture_output=True, text=True)
        assert p.returncode == 125 and "symlink" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    finally:
        shutil.rmtree(victim)


@pytest.mark.parametrize("declared", ["/etc", "/etc/security"])
def test_host_secrets_stay_masked_under_a_declared_ro_path(user: User, declared: str) -> None:
    secret = "/etc/shadow" if declared == "/etc" else "/etc/security/opasswd"
    if not os.path.exists(secret):
        pytest.skip(f"{secret} does not exist on this host")
    r = agentcell_run([*as_uid(user), "--ro", declared, "--", "stat", "-c", "%s %a", secret])
    assert r.rc == 0, r.err
    assert r.out.splitlines() == ["0 0"]


def test_submounts_of_a_ro_path_are_read_only_too(user: User) -> None:
    base = Path(f"/tmp/agentcell-submount-{os.getpid()}")
    sub = base / "sub"
    sub.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0777", "agentcell-test", str(sub)], check=True)
    try:
        r = agentcell_run([*as_uid(user), "--ro", str(base), "--", "sh", "-c",
                           f"echo x > {sub}/f && echo WROTE; grep ' {sub} ' /proc/self/mountinfo"])
        assert "WROTE" not in r.out
        assert " ro," in r.out and "nosuid" in r.out and "nodev" in r.out, r.out
    finally:
        subprocess.run(["umount", str(sub)], check=True)
        shutil.rmtree(base)


def test_the_same_directory_declared_twice_is_refused(user: User, project: Path) -> None:
    alias = Path(f"/tmp/agentcell-alias-{os.getpid()}")
    alias.mkdir()
    subprocess.run(["mount", "--bind", str(project), str(alias)], check=True)
    try:
        p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), "--rw", str(project), "--ro", str(alias), "--",
                            "true"], capture_output=True, text=True)
        assert p.returncode != 0 and "same directory" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
    finally:
        subprocess.run(["umount", str(alias)], check=True)
        alias.rmdir()


SWAP_DURING_BUILD = """
import ctypes, os, sys
from agentcell.cell import launch, mounts
from agentcell.cell.spec import CellSpec
from agentcell.protect.binds import for_cell
from agentcell.policy.resolve import build_env, resolve_identity
project, uid = sys.argv[1], sys.argv[2]
ro = project + "/b"
libc = ctypes.CDLL(None, use_errno=True)
real_target = mounts._target

def target(rel, is_dir, root_fd, owned):
    # Just before the --ro bind is attached, swap its name with a decoy's, as a process of the agent's
    # outside the cell could (through the cell's own rw bind of the project, which is the host's dir).
    if rel == ro:
        a, b = (os.fsencode(mounts.NEWROOT + p) for p in (ro, project + "/decoy"))
        assert libc.syscall(316, -100, a, -100, b, 2) == 0
    return real_target(rel, is_dir, root_fd, owned)

mounts._target = target
ident = resolve_identity(uid, euid=0)
spec = CellSpec(ident, rw_paths=(project,), ro_paths=(ro,), env=build_env({}, ident))
r = launch.launch(spec, ["sh", "-c", f"for d in {project}/*; do echo x >> $d/ORIG 2>/dev/null && echo WROTE $d; done"],
                  guards=for_cell(spec))
print(r.exit_status, r.error)
"""


def test_a_rename_while_the_cell_is_built_cannot_move_a_ro_bind(user: User, project: Path) -> None:
    ro, decoy = project / "b", project / "decoy"
    for d in (ro, decoy):
        d.mkdir()
        shutil.chown(d, user.uid, user.gid)
    (ro / "ORIG").write_text("original\n")
    shutil.chown(ro / "ORIG", user.uid, user.gid)
    p = subprocess.run([sys.executable, "-c", SWAP_DURING_BUILD, str(project), str(user.uid)],
                       capture_output=True, text=True)
    assert "was replaced while the cell was built" in p.stdout, p.stdout + p.stderr
    assert "WROTE" not in p.stdout
    orig = ro / "ORIG" if (ro / "ORIG").exists() else decoy / "ORIG"
    assert orig.read_text() == "original\n"


@pytest.mark.parametrize("mode", ["required", "best-effort"])
def test_without_landlock_the_launch_fails_closed_unless_best_effort(user: User, mode: str) -> None:
    deny = deny_syscall(444, 38)  # landlock_create_ruleset -> ENOSYS: a kernel without Landlock
    p = subprocess.run([sys.executable, "-c", deny, AGENTCELL, "run", "--no-warm", "--as", str(user.uid),
                        "--landlock", mode, "--", "echo", "RAN"], capture_output=True, text=True)
    if mode == "required":
        assert p.returncode == 123 and "RAN" not in p.stdout, p.stdout + p.stderr
        assert "Landlock ABI is 0" in p.stderr and "best-effort" in p.stderr
    else:
        assert p.returncode == 0 and p.stdout.strip() == "RAN", p.stdout + p.stderr


TAKEOVER = """
import fcntl, os, termios
for fd in (0, 1, 2):  # a terminal no session owns could become ours (TIOCSCTTY), then take keystrokes
    try:
        fcntl.ioctl(fd, termios.TIOCSCTTY, 0)
    except OSError:
        pass
    try:
        for c in b"echo INJECTED\\\\n":
            fcntl.ioctl(fd, termios.TIOCSTI, bytes([c]))
        print("pushed into fd", fd, "which is", os.ttyname(fd))
    except OSError:
        pass
"""


def _pending_input(slave: int) -> bytes:
    os.set_blocking(slave, False)
    try:
        return os.read(slave, 4096)
    except BlockingIOError:
        return b""


def test_a_terminal_that_no_session_owns_never_reaches_the_cell(user: User) -> None:
    # A harness gives the cell a pty of its own making (not its controlling terminal), as harnesses do
    # for coloured output; whatever reaches that terminal's input would be read by its next command.
    master, slave = os.openpty()
    try:
        p = subprocess.run([AGENTCELL, "run", "--no-warm", "--as", str(user.uid), "--", "python3", "-c", TAKEOVER],
                           stdin=slave, stdout=slave, stderr=slave, timeout=60)
        assert p.returncode == 0
        assert b"INJECTED" not in _pending_input(slave)
    finally:
        os.close(master)
        os.close(slave)


def test_the_python_api_never_hands_a_terminal_to_a_cell(user: User) -> None:
    from agentcell import Cell, CellSpec
    from agentcell.policy.resolve import build_env, resolve_identity

    ident = resolve_identity(str(user.uid), euid=0)
    master, slave = os.openpty()
    try:
        with Cell(CellSpec(ident, env=build_env({}, ident))) as cell:
            proc = cell.spawn(["python3", "-c", TAKEOVER], stdin=slave, stdout=slave, stderr=slave)
            assert proc.wait(timeout=60) == 0
        assert b"INJECTED" not in _pending_input(slave)
    finally:
        os.close(master)
        os.close(slave)


def test_a_cell_that_reads_no_input_cannot_stall_the_relay_or_its_timeout(user: User) -> None:
    argv = [AGENTCELL, "run", "--no-warm", "--as", str(user.uid), "--timeout", "2", "--", "sleep", "60"]
    with OnTerminal(argv) as term:
        os.set_blocking(term.fd, False)
        sent = 0
        for _ in range(400):  # keep typing into a cell that never reads: the pty's buffers fill up
            try:
                sent += os.write(term.fd, b"x" * 1024)
            except BlockingIOError:
                pass
            except OSError:
                break
            read_until(term.fd, b"\x00never", limit_s=0.01)
            if term.wait(nohang=True):
                break
        if term.pid:
            read_until(term.fd, b"\x00never", limit_s=20)
            term.wait()
        status = term.status
    assert sent > 4096
    assert os.waitstatus_to_exitcode(status) == 124


@pytest.mark.parametrize("command", ["run", "doctor", "warm"])
def test_help_is_printed_not_a_traceback(command: str) -> None:
    p = subprocess.run([AGENTCELL, command, "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "usage:" in p.stdout and "Traceback" not in p.stderr, p.stderr


def test_the_agent_cannot_claim_root_as_its_audit_login_uid(user: User) -> None:
    code = ("import os\ntry:\n    fd = os.open('/proc/self/loginuid', os.O_WRONLY); os.write(fd, b'0')\n"
            "except OSError as e:\n    print('REFUSED', e.errno)\nprint(open('/proc/self/loginuid').read())")
    r = agentcell_run([*as_uid(user), "--", "python3", "-c", code])
    lines = r.out.split()
    assert lines[0] == "REFUSED" and lines[-1] != "0", r.out + r.err


def test_the_version_is_one_line_and_an_unknown_command_names_the_known_ones() -> None:
    from importlib.metadata import version

    p = subprocess.run([AGENTCELL, "--version"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == f"agentcell {version('agentcell')}\n", p
    p = subprocess.run([AGENTCELL, "--versoin"], capture_output=True, text=True)
    assert p.returncode != 0 and "one of: run," in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr


def test_a_hand_off_message_without_its_fds_fails_the_launch() -> None:
    """A cell's fd that does not arrive (the supervisor out of fds: the kernel drops it from the message)
    must fail the launch, not leave the cell running without what it was for (the monitor's seccomp
    listener, a canary's watch); a cell that failed first (the channel's end) is None, its status says why."""
    import _socket

    from agentcell.cell import handoff
    from agentcell.errors import LaunchError

    a, b = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    try:
        a.send(b"S")
        with pytest.raises(LaunchError, match="came without its"):
            handoff.recv_fd(b, b"S")
        r, w = os.pipe()
        handoff.send_fds(a, [r, w], b"R")
        os.close(r)
        os.close(w)
        got = handoff.recv_fds(b, b"R", 2)
        assert got is not None and len(got) == 2
        for fd in got:
            os.close(fd)
        a.close()
        assert handoff.recv_fd(b, b"S") is None
    finally:
        b.close()
