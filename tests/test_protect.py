"""Protected paths inside a writable project: hooks, git config and harness config stay read-only,
while ordinary git work goes on."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import AGENTCELL, User, agentcell_run, needs_root

pytestmark = needs_root

GIT = ["git", "-c", "user.name=agent", "-c", "user.email=agent@agentcell.invalid", "-c", "safe.directory=*"]


def _as_user(user: User, *argv: str, cwd: Path) -> None:
    subprocess.run([*user.prefix(), *argv], cwd=cwd, check=True, capture_output=True)


def make_repo(user: User, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    shutil.chown(path, user.uid, user.gid)
    _as_user(user, "git", "init", "-q", str(path), cwd=path)
    for name in (".mcp.json", ".envrc"):
        (path / name).write_text("{}\n")
        shutil.chown(path / name, user.uid, user.gid)
    (path / ".claude").mkdir()
    shutil.chown(path / ".claude", user.uid, user.gid)


PLANT = """
set -u
p=$1
try() { if sh -c "$1" 2>/dev/null; then echo "WROTE $2"; else echo "DENIED $2"; fi; }
try "echo evil > $p/.git/hooks/pre-commit" hooks
try "echo '[core] fsmonitor = evil' >> $p/.git/config" config
try "echo x > $p/sub/.git/hooks/post-checkout" nested-hooks
try "echo x >> $p/sub/.git/config" nested-config
try "echo '{}' > $p/.claude/settings.json" claude
try "echo x >> $p/.mcp.json" mcp
try "echo x >> $p/.envrc" envrc
echo work > $p/work.txt
git -c user.name=agent -c user.email=a@agentcell.invalid -c safe.directory='*' -C $p add work.txt \
  && git -c user.name=agent -c user.email=a@agentcell.invalid -c safe.directory='*' -C $p commit -qm work \
  && echo COMMITTED
"""


def test_hooks_git_config_and_harness_config_are_read_only_and_git_still_works(user: User, project: Path) -> None:
    make_repo(user, project)
    make_repo(user, project / "sub")
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c", PLANT, "sh", str(project)])
    assert "WROTE" not in r.out, r.out + r.err
    assert r.out.count("DENIED") == 7 and "COMMITTED" in r.out, r.out + r.err
    assert not (project / ".git/hooks/pre-commit").exists()
    assert "fsmonitor" not in (project / ".git/config").read_text()
    log = subprocess.run([*GIT, "-C", str(project), "log", "--oneline"], capture_output=True, text=True).stdout
    assert "work" in log


def test_allow_write_lifts_one_protected_path(user: User, project: Path) -> None:
    make_repo(user, project)
    hooks = project / ".git" / "hooks"
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--allow-write", str(hooks), "--", "sh", "-c",
                       f"echo ok > {hooks}/pre-commit && echo HOOK; echo x >> {project}/.git/config || echo CONFIG-RO"])
    assert r.out.split() == ["HOOK", "CONFIG-RO"], r.out + r.err


def test_explain_lists_the_protected_paths(user: User, project: Path) -> None:
    make_repo(user, project)
    p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), "--rw", str(project), "--explain", "--", "true"],
                       capture_output=True, text=True)
    assert f"{project}/.git/hooks" in p.stdout and f"bind ro,nosuid,nodev {project}/.mcp.json" in p.stdout


def test_allow_write_outside_the_project_is_refused(user: User, project: Path, tmp_path: Path) -> None:
    p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), "--rw", str(project), "--allow-write",
                        str(tmp_path), "--", "true"], capture_output=True, text=True)
    assert p.returncode == 125 and "--allow-write" in p.stderr


def test_protected_entries_the_command_creates_are_quarantined(user: User, project: Path) -> None:
    make_repo(user, project)
    shutil.rmtree(project / ".claude")
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"mkdir {project}/.claude && echo '{{\"x\": 1}}' > {project}/.claude/settings.json"])
    assert r.result["protected_changes"] == [f"{project}/.claude"], r.result
    moved = Path(r.result["quarantined"][f"{project}/.claude"])
    box = moved.parent
    assert box.parent == project and box.name.startswith(f".agentcell-quarantine-{r.result['cell_id']}-"), r.result
    assert moved.name == ".claude" and not os.path.lexists(project / ".claude")
    assert (moved / "settings.json").read_text() == '{"x": 1}\n'  # kept for review, not deleted
    assert (box.stat().st_uid, oct(box.stat().st_mode & 0o777)) == (0, "0o700")  # the agent cannot reach it
    assert "moved to" in r.err and "--allow-write" in r.err


def test_allow_write_lets_the_command_create_a_protected_entry(user: User, project: Path) -> None:
    make_repo(user, project)
    (project / "AGENTS.md").unlink(missing_ok=True)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--allow-write", str(project / "AGENTS.md"),
                       "--", "sh", "-c", f"echo notes > {project}/AGENTS.md"])
    assert r.rc == 0, r.err
    assert (project / "AGENTS.md").read_text() == "notes\n" and r.result["quarantined"] == {}, r.result


def test_quarantine_moves_nothing_that_existed_before(user: User, project: Path) -> None:
    make_repo(user, project)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"echo more >> {project}/README.md; git -C {project} status >/dev/null; true"])
    assert r.rc == 0 and r.result["quarantined"] == {}, r.result
    assert not list(project.glob(".agentcell-quarantine*"))


GIT_REDIRECTS = {
    "commondir": "mkdir {p}/.git/x && cp -r {p}/.git/objects {p}/.git/refs {p}/.git/HEAD {p}/.git/x/ && "
                 "echo x > {p}/.git/commondir",
    "config_worktree": "echo '[core]' > {p}/.git/config.worktree",
    "gitfile_of_a_new_nested_repo": "mkdir -p {p}/tools/fmt && echo 'gitdir: ../../.evil' > {p}/tools/fmt/.git",
    "symlinked_harness_config": "mkdir -p {p}/docs && echo x > {p}/docs/m.json && ln -s docs/m.json {p}/.mcp.json",
}


@pytest.mark.parametrize("attack", sorted(GIT_REDIRECTS))
def test_what_cannot_be_bound_is_compared_and_reported(user: User, project: Path, attack: str) -> None:
    make_repo(user, project)
    (project / ".mcp.json").unlink()
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       GIT_REDIRECTS[attack].format(p=project)])
    assert r.rc == 0, r.err
    assert r.result["protected_changes"], r.result
    assert "warning" in r.err
    for created in r.result["quarantined"]:  # what did not exist before the run is moved aside
        assert not os.path.lexists(created), created


def test_submodule_git_dirs_at_any_depth_are_protected(user: User, project: Path) -> None:
    make_repo(user, project)
    nested = project / ".git" / "modules" / "vendor" / "lib"
    nested.mkdir(parents=True)
    for name in ("HEAD", "config"):
        (nested / name).write_text("ref: refs/heads/main\n" if name == "HEAD" else "[core]\n")
    (nested / "hooks").mkdir()
    subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(project / ".git")], check=True)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"echo x >> {nested}/config || echo CONFIG-RO; echo x > {nested}/hooks/post-checkout "
                       "|| echo HOOKS-RO"])
    assert r.out.split() == ["CONFIG-RO", "HOOKS-RO"], r.out + r.err


def test_hard_linked_protected_files_do_not_break_the_launch(user: User, project: Path) -> None:
    make_repo(user, project)
    os.link(project / ".mcp.json", project / "opencode.json")
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"echo x >> {project}/opencode.json || echo RO"])
    assert r.rc == 0 and r.out.strip() == "RO", r.out + r.err


def test_a_hooks_path_in_the_work_tree_and_nested_harness_config_are_read_only(user: User, project: Path) -> None:
    make_repo(user, project)
    for d in (project / ".husky", project / "src" / ".claude"):
        d.mkdir(parents=True)
        shutil.chown(d, user.uid, user.gid)
    shutil.chown(project / "src", user.uid, user.gid)
    _as_user(user, "git", "-C", str(project), "config", "core.hooksPath", ".husky", cwd=project)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"echo x > {project}/.husky/pre-commit || echo HUSKY-RO; "
                       f"echo x > {project}/src/.claude/settings.json || echo NESTED-RO"])
    assert r.out.split() == ["HUSKY-RO", "NESTED-RO"], r.out + r.err


QUARANTINE_ATTACKS = {
    # A config the command writes names the user's files as hooksPath/include targets: they are not
    # part of the structure, so never moved (first version: renamed, read-only as they were).
    "config_targets_of_users_files": "mkdir -p {p}/.git/modules/x && echo 'ref: refs/heads/master' > "
        "{p}/.git/modules/x/HEAD && printf '[core]\\n\\thooksPath = .claude/settings.json\\n[include]\\n"
        "\\tpath = {p}/.git/hooks/pre-commit\\n' > {p}/.git/modules/x/config",
    # A NUL in a config value: the scan must not crash (first version: a traceback, nothing moved).
    "nul_in_config": "mkdir -p {p}/.git/modules/x && echo 'ref: refs/heads/master' > {p}/.git/modules/x/HEAD && "
        "printf '[core]\\n\\thooksPath = a\\000b\\n' > {p}/.git/modules/x/config && echo x > {p}/.envrc2",
    # A FIFO or /dev/zero as a config: the supervisor must neither block nor read without end.
    "fifo_config": "mkdir -p {p}/.git/modules/x && echo 'ref: refs/heads/master' > {p}/.git/modules/x/HEAD && "
        "mkfifo {p}/.git/modules/x/config",
    "dev_zero_config": "mkdir -p {p}/.git/modules/x && echo 'ref: refs/heads/master' > {p}/.git/modules/x/HEAD && "
        "ln -s /dev/zero {p}/.git/modules/x/config",
}


@pytest.mark.parametrize("attack", sorted(QUARANTINE_ATTACKS))
def test_quarantine_never_moves_the_users_files_nor_hangs(user: User, project: Path, attack: str) -> None:
    make_repo(user, project)
    (project / ".claude" / "settings.json").write_text('{"deny": ["Bash(*)"]}\n')
    hook = project / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\necho scan\n")
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       QUARANTINE_ATTACKS[attack].format(p=project) + f" && echo 'echo PWNED' > {project}/.envrc2"
                       f" && mkdir {project}/sub && echo x > {project}/sub/.envrc"], timeout=30)
    assert r.rc == 0 and "Traceback" not in r.err, r.err
    assert (project / ".claude" / "settings.json").read_text() == '{"deny": ["Bash(*)"]}\n'
    assert hook.read_text() == "#!/bin/sh\necho scan\n"
    assert not (project / "sub" / ".envrc").exists()  # what the command created still moves
    moved = r.result["quarantined"]
    assert f"{project}/sub/.envrc" in moved and not any(k.endswith(("settings.json", "pre-commit")) for k in moved)


def test_a_planted_bare_repository_is_quarantined(user: User, project: Path) -> None:
    # git takes a directory with HEAD, objects/ and refs/ for a bare repository: its config (a pager,
    # say) would run for whoever next types git log there.
    shutil.chown(project, user.uid, user.gid)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"mkdir -p {project}/src/objects {project}/src/refs && echo 'ref: refs/heads/main' > "
                       f"{project}/src/HEAD && printf '[core]\\n\\tpager = id\\n' > {project}/src/config"])
    assert sorted(r.result["quarantined"]) == [f"{project}/src/HEAD", f"{project}/src/config"], r.result
    assert not (project / "src" / "config").exists()


def test_a_truncated_scan_moves_only_what_the_cell_made_during_the_run(user: User, project: Path) -> None:
    # A before-scan cut short (too many directories) does not know which entries are new: what the
    # cell's own uid made during the run (its ctime says when; nobody but root can set it back) still
    # moves, the user's entries do not. An agent cannot switch quarantine off by making the tree big.
    make_repo(user, project)
    for i in range(5001):
        (project / f"d{i}").mkdir()
    (project / "d1" / "CLAUDE.md").write_text("the user's\n")
    old = project / "AGENTS.md"  # the cell uid's, from an earlier run: not this run's doing
    old.write_text("accepted earlier\n")
    shutil.chown(old, user.uid, user.gid)
    time.sleep(0.3)  # its ctime is now well before the run's start (file times are coarse: 0.1 s slack)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"echo planted > {project}/CLAUDE.md"], timeout=60)
    assert r.result["scan_truncated"] is True, r.result
    assert list(r.result["quarantined"]) == [f"{project}/CLAUDE.md"], r.result
    assert (project / "d1" / "CLAUDE.md").read_text() == "the user's\n"


def test_allow_write_of_a_new_entry_inside_a_protected_directory_is_refused(user: User, project: Path) -> None:
    make_repo(user, project)
    p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), "--rw", str(project), "--allow-write",
                        str(project / ".git" / "hooks" / "post-merge"), "--", "true"], capture_output=True, text=True)
    assert p.returncode == 125 and "name" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    # An existing entry inside one is lifted alone: its directory stays read-only.
    (project / ".claude" / "notes.md").write_text("n\n")
    shutil.chown(project / ".claude" / "notes.md", user.uid, user.gid)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--allow-write",
                       str(project / ".claude" / "notes.md"), "--", "sh", "-c",
                       f"echo more >> {project}/.claude/notes.md && echo {{}} > {project}/.claude/settings.json "
                       "|| echo DENIED"])
    assert r.out.strip() == "DENIED" and (project / ".claude" / "notes.md").read_text() == "n\nmore\n", r.err


def test_warnings_do_not_carry_terminal_escapes(user: User, project: Path) -> None:
    shutil.chown(project, user.uid, user.gid)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"mkdir \"{project}/$(printf 'x\\033]52;c;AAAA\\007')\" && "
                       f"echo x > \"{project}/$(printf 'x\\033]52;c;AAAA\\007')/.envrc\""])
    assert r.result["quarantined"], r.result
    assert "\x1b" not in r.err and "\\x1b" in r.err


def test_quarantine_follows_no_symlink_and_moves_only_what_was_scanned(tmp_path: Path) -> None:
    # The after-run step may run as root: a parent swapped for a symlink, or an entry replaced since
    # the scan, must move nothing (here, outside's .envrc stands for a file of somebody else's).
    from agentcell.protect import check, surface

    project, outside = tmp_path / "p", tmp_path / "outside"
    (project / "sub").mkdir(parents=True)
    outside.mkdir()
    before, _ = surface.surface((str(project),))
    for d in (project, project / "sub", outside):
        (d / ".envrc").write_text("x\n")
    after, _ = surface.surface((str(project),))
    assert {f"{project}/.envrc", f"{project}/sub/.envrc"} <= set(after)
    (project / ".envrc").unlink()
    (project / ".envrc").write_text("replaced\n")  # a new inode under the same name
    shutil.rmtree(project / "sub")
    (project / "sub").symlink_to(outside)
    moved, failed = check.quarantine(before, after, "c1", (str(project),))
    assert moved == [] and sorted(failed) == [f"{project}/.envrc", f"{project}/sub/.envrc"]
    assert (outside / ".envrc").read_text() == "x\n" and (project / ".envrc").read_text() == "replaced\n"


def test_a_planted_box_name_does_not_stop_quarantine(user: User, project: Path) -> None:
    shutil.chown(project, user.uid, user.gid)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"echo x > {project}/.agentcell-quarantine; mkdir {project}/.agentcell-quarantine-a; "
                       f"echo evil > {project}/.envrc"])
    assert list(r.result["quarantined"]) == [f"{project}/.envrc"], r.result


def test_a_directory_renamed_into_a_protected_name_is_quarantined(user: User, project: Path) -> None:
    # The user's own directory, which the agent may write, renamed into .claude with a settings file
    # planted: not the cell's by owner, but new at that name during the run.
    make_repo(user, project)
    shutil.rmtree(project / ".claude")
    (project / "docs").mkdir()
    (project / "docs" / "guide.md").write_text("the user's\n")
    os.chmod(project / "docs", 0o777)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"mv {project}/docs {project}/.claude && "
                       f"echo '{{\"hooks\": 1}}' > {project}/.claude/settings.json"])
    moved = r.result["quarantined"].get(f"{project}/.claude")
    assert moved and (Path(moved) / "guide.md").read_text() == "the user's\n", r.result  # moved, not lost


def test_a_symlinked_modules_dir_does_not_walk_the_host(user: User, project: Path) -> None:
    make_repo(user, project)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "ln", "-s", "/", f"{project}/.git/modules"])
    assert r.rc == 0, r.err
    again = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "true"])
    assert again.rc == 0, again.err  # no refusal: the link is not taken for a submodule tree
    assert not any("/work" in p or "/root" in p for p in (*again.result["protected_changes"],
                                                         *r.result["protected_changes"]))


def test_a_truncated_scan_is_said_out_loud(user: User, project: Path) -> None:
    shutil.chown(project, user.uid, user.gid)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(project), "--", "sh", "-c",
                       f"cd {project} && for i in $(seq 5010); do mkdir d$i; done"], timeout=60)
    assert r.result["scan_truncated"] is True and "scan covers" in r.err, r.err
