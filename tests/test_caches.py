"""The toolchain caches' store (issue 26, :mod:`agentcell.caches`): what is handed to a session's account
and what is not, and which sessions share an entry. Sessions that use them: test_benign.py (pip and npm
from the registries' stand-ins, a second session from the cache, another project without it) and
test_rootless_session.py (a user's own)."""
from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell import caches
from conftest import User, needs_root


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
    assert [e["project"] for e in caches.entries()] == [str(project)]
    assert caches.clear(caches.entries()) == [os.path.dirname(tree)] and not os.path.exists(tree)
