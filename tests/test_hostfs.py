"""hostfs: the one place that decides "only you or root can change this", on real files (modes, POSIX
ACLs through setfacl, hard links, sticky directories), and the callers that merged into it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from agentcell import hostfs
from conftest import User, needs_root


def _only(p: Path) -> bool:
    fd = os.open(p, os.O_PATH | os.O_NOFOLLOW)
    try:
        return hostfs.only_ours(fd)
    finally:
        os.close(fd)


def test_mode_acl_and_links_decide_who_can_change_a_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    os.chmod(f, 0o644)
    assert _only(f)
    os.chmod(f, 0o664)
    assert not _only(f)  # the group may write
    os.chmod(f, 0o644)
    subprocess.run(["setfacl", "-m", "u:65534:rw", str(f)], check=True)
    assert not _only(f)  # a named user may write
    subprocess.run(["setfacl", "-m", "m::r", str(f)], check=True)
    assert _only(f)  # ... not through the mask
    subprocess.run(["setfacl", "-b", str(f)], check=True)
    os.link(f, tmp_path / "g")
    assert not _only(f)  # another name, made elsewhere, is the same file
    (tmp_path / "link").symlink_to(f)
    assert not hostfs.only_ours_at(str(tmp_path / "link"))  # a link is never followed


def test_a_sticky_directory_is_ours_only_when_asked(tmp_path: Path) -> None:
    d = tmp_path / "t"
    d.mkdir()
    os.chmod(d, 0o1777)
    fd = os.open(d, os.O_PATH)
    try:
        assert not hostfs.only_ours(fd) and hostfs.only_ours(fd, sticky_ok=True)
    finally:
        os.close(fd)


@needs_root
def test_another_owner_is_not_ours(tmp_path: Path, user: User) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    os.chown(f, user.uid, user.gid)
    assert not _only(f) and not hostfs.only_ours_at(str(f), {0})
    assert hostfs.only_ours_at(str(f), {user.uid})


@needs_root
def test_an_audit_log_another_user_may_write_through_an_acl_is_refused(tmp_path: Path) -> None:
    """Tightened when the trail's check merged into hostfs: it looked at the mode only."""
    from agentcell.audit.trail import AuditLog
    from agentcell.errors import AgentcellError

    log = AuditLog(str(tmp_path / "audit.jsonl"))
    log.append("test.one", session="s1")
    subprocess.run(["setfacl", "-m", "u:65534:rw", log.path], check=True)
    with pytest.raises((AgentcellError, ValueError), match="no one else can write"):
        log.append("test.two", session="s1")


@needs_root
def test_a_snapshot_store_another_user_may_write_through_an_acl_is_refused(tmp_path: Path) -> None:
    """Tightened when the store's check merged into hostfs: it looked at the mode only."""
    from agentcell.snapshot.store import SnapshotError, Store

    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    subprocess.run(["setfacl", "-m", "u:65534:rwx", str(store)], check=True)
    with pytest.raises(SnapshotError, match="nobody else can write"):
        Store(str(store))._ready()
