"""The toolchain caches' store (issue 26, :mod:`agentcell.caches`): what is handed to a session's account
and what is not, and which sessions share an entry. Sessions that use them: test_benign.py (pip and npm
from the registries' stand-ins, a second session from the cache, another project without it) and
test_rootless_session.py (a user's own)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell import caches
from conftest import AGENTCELL, User, needs_root
from sessionkit import Env, session, session_environ
from sessionkit import env as env  # noqa: F401 - the fixture, under its own name


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("AGENTCELL_STATE_DIR", str(tmp_path / "state"))
    yield tmp_path


def test_each_project_and_each_agent_on_it_has_its_own_entry_and_a_link_to_a_project_is_the_project(
        state: Path) -> None:
    a, b = state / "a", state / "b"
    a.mkdir()
    b.mkdir()
    (state / "link").symlink_to(a)
    assert caches.key(str(a), None) == caches.key(str(state / "link"), None)
    keys = {caches.key(str(a), None), caches.key(str(b), None), caches.key(str(a), "ada"), caches.key(str(a), "bob")}
    assert len(keys) == 4 and all("/" not in k for k in keys)
    odd = state / os.fsdecode(b"p\xff")
    odd.mkdir()
    assert caches.key(str(odd), None).isascii()


def test_the_session_sets_only_what_it_does_not_set_itself() -> None:
    env = caches.environment({"PIP_CACHE_DIR": "/mine"})
    assert "PIP_CACHE_DIR" not in env and env["npm_config_cache"] == "/cache/npm"
    assert env["GOMODCACHE"] == "/cache/go/mod" and env["CARGO_HOME"] == "/cache/cargo"
    assert env["UV_LINK_MODE"] == "copy" and "UV_LINK_MODE" not in caches.environment({"UV_LINK_MODE": "symlink"})


@needs_root
def test_what_is_handed_to_the_account_and_what_is_not(state: Path, user: User) -> None:
    """Everything in the tree becomes the account's, without setuid/setgid bits or write for others;
    a regular file with another link (one the agent could have linked in) is left as it is, and a link's
    target outside is never touched."""
    outside = state / "outside"
    outside.write_text("host file\n")
    project = state / "proj"
    project.mkdir()
    tree, left = caches.prepare(str(project), None, (user.uid, user.gid))
    t = Path(tree)
    assert left == [] and t.stat().st_uid == user.uid and (t / "pip").stat().st_uid == user.uid
    assert (t / "go" / "mod").is_dir() and stat.S_IMODE(Path(os.path.dirname(tree)).stat().st_mode) == 0o700
    (t / "pip" / "suid").write_text("x")
    os.chmod(t / "pip" / "suid", 0o4777)
    (t / "pip" / "acl").write_text("z")
    subprocess.run(["setfacl", "-m", "u:4242:rwx", str(t / "pip" / "acl"), str(t / "pip")], check=True)
    (t / "pip" / "linked").write_text("y")
    os.link(t / "pip" / "linked", state / "second-name")
    (t / "pip" / "out").symlink_to(outside)
    for p in (t / "pip" / "suid", t / "pip" / "linked"):
        os.chown(p, 0, 0)
    tree2, left = caches.prepare(str(project), None, (user.uid + 1, user.gid + 1))
    assert tree2 == tree and len(left) == 1 and "linked has other links" in left[0], left
    suid = (t / "pip" / "suid").stat()
    assert (suid.st_uid, stat.S_IMODE(suid.st_mode)) == (user.uid + 1, 0o775)
    assert (t / "pip" / "linked").stat().st_uid == 0 and outside.stat().st_uid == 0
    assert (t / "pip" / "out").lstat().st_uid == user.uid + 1
    for p in (t / "pip" / "acl", t / "pip"):  # no one else's way in, whoever granted it
        assert "4242" not in subprocess.run(["getfacl", "-n", str(p)], capture_output=True, text=True).stdout
    assert [e["project"] for e in caches.entries()] == [str(project)]
    assert caches.clear(caches.entries()) == [os.path.dirname(tree)] and not os.path.exists(tree)


@needs_root
def test_a_tree_too_deep_for_recursion_is_listed_and_cleared(state: Path, user: User) -> None:
    project = state / "deep"
    project.mkdir()
    tree, _ = caches.prepare(str(project), None, (user.uid, user.gid))
    fd = os.open(os.path.join(tree, "pip"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1500):  # deeper than Python's recursion limit
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("x" * 10000)
    finally:
        os.close(fd)
    (listed,) = caches.entries()
    assert listed["bytes"] is not None and listed["bytes"] >= 10000 and listed["tools"] == ["pip"]
    assert caches.clear([listed]) == [os.path.dirname(tree)] and not os.path.exists(os.path.dirname(tree))


@needs_root
def test_a_session_ended_at_an_escape_leaves_no_cache_for_the_next_one(env: Env) -> None:
    """What an agent wrote in /cache before it was ended (a cargo config that would wrap the next
    build) is not there for the next session: the cache is emptied and the summary says so."""
    plant = ("mkdir -p /cache/cargo && echo '[build]' > /cache/cargo/config.toml && "
             "echo 'rustc-wrapper = \"/cache/cargo/w.sh\"' >> /cache/cargo/config.toml && "
             "cat ~/.ssh/id_ed25519; sleep 5")
    s = session(env, ["start", "--harness", "shell", "--json", "--", "sh", "-c", plant])
    assert s.summary["status"] == "terminated", (s.out, s.err)
    assert any("toolchain cache was emptied" in w for w in s.summary["warnings"]), s.summary
    listed = json.loads(subprocess.run([AGENTCELL, "cache", "list", "--json"], env=session_environ(env),
                                       capture_output=True, text=True, check=True).stdout)
    assert listed == [], listed
    s = session(env, ["start", "--harness", "shell", "--json", "--", "sh", "-c",
                      "ls -A /cache/cargo; test ! -e /cache/cargo/config.toml && echo clean"])
    assert s.summary["status"] == "completed" and "clean" in s.out, (s.out, s.err)
