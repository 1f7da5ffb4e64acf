"""Snapshots (issue 6, part 1): exact restores after real agent runs, incremental takes, a store that
says when it is damaged, unwritable or full."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell.snapshot import SnapshotError, Store
from conftest import AGENTCELL, User, agentcell_run, needs_root

pytestmark = needs_root


def signature(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything a restore must give back, per entry (never following a symlink)."""
    out: dict[str, tuple[object, ...]] = {}
    for d, dirs, files in os.walk(root, followlinks=False):
        for name in [".", *dirs, *files] if d == str(root) else [*dirs, *files]:
            p = Path(d) / name if name != "." else Path(d)
            st = p.lstat()
            rel = os.path.relpath(p, root)
            extra: object = None
            if stat.S_ISREG(st.st_mode):
                extra = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            mtime = st.st_mtime_ns if not stat.S_ISDIR(st.st_mode) or rel != "." else None
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, mtime, extra)
    return out


@pytest.fixture
def tree(user: User, tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "proj"
    (root / "src" / "deep").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "src" / "main.py").write_text("print('hello')\n")
    (root / "src" / "deep" / "data.bin").write_bytes(os.urandom(200_000))
    (root / "notes.txt").write_text("one\ntwo\n")
    (root / "link").symlink_to("notes.txt")
    (root / "script.sh").write_text("#!/bin/sh\n")
    (root / "script.sh").chmod(0o755)
    for p in [root, *root.rglob("*")]:
        os.lchown(p, user.uid, user.gid)
    tmp_path.chmod(0o755)
    yield root


def test_restore_undoes_what_an_agent_did(user: User, tree: Path, tmp_path: Path) -> None:
    store = Store(str(tmp_path / "store"))
    before = signature(tree)
    sid = store.take([str(tree)])
    r = agentcell_run(["--as", str(user.uid), "--rw", str(tree), "--", "sh", "-c",
                       f"cd {tree} && echo changed >> notes.txt && rm src/main.py && echo new > added.txt && "
                       "chmod 600 script.sh && rm -r empty && mkdir made && rm link && ln -s /etc/passwd link && "
                       "rm src/deep/data.bin && ln -s /etc src/deep/data.bin && touch -d '2001-01-01' notes.txt"])
    assert r.rc == 0, r.err
    assert signature(tree) != before
    d = store.diff(sid)
    assert f"{tree}/added.txt" in d["added"] and f"{tree}/src/main.py" in d["deleted"]
    assert f"{tree}/notes.txt" in d["modified"] and f"{tree}/link" in d["modified"]
    assert "+changed" in store.text_diff(sid, str(tree / "notes.txt"))
    store.restore(sid)
    assert signature(tree) == before
    assert store.diff(sid) == {"added": [], "modified": [], "deleted": []}


def test_restore_never_writes_through_a_directory_swapped_for_a_symlink(user: User, tree: Path,
                                                                        tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("root's\n")
    store = Store(str(tmp_path / "store"))
    before = signature(tree)
    sid = store.take([str(tree)])
    shutil.rmtree(tree / "src")
    (tree / "src").symlink_to(outside)  # as an agent could leave it
    store.restore(sid)
    assert signature(tree) == before
    assert sorted(p.name for p in outside.iterdir()) == ["keep"] and (outside / "keep").read_text() == "root's\n"


def test_restore_to_another_directory(tree: Path, tmp_path: Path) -> None:
    store = Store(str(tmp_path / "store"))
    sid = store.take([str(tree)])
    elsewhere = tmp_path / "copy"
    store.restore(sid, to=str(elsewhere))
    assert signature(elsewhere / str(tree).lstrip("/")) == signature(tree)


def test_a_second_snapshot_reads_only_what_changed(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(str(tmp_path / "store"))
    store.take([str(tree)])
    reads: list[str] = []
    real = Store._put

    def counting(self: Store, root: str, rel: str, st: os.stat_result) -> str:
        reads.append(rel)
        return real(self, root, rel, st)
    monkeypatch.setattr(Store, "_put", counting)
    objects = sorted((tmp_path / "store" / "objects").rglob("*"))
    store.take([str(tree)])
    assert reads == [] and sorted((tmp_path / "store" / "objects").rglob("*")) == objects  # nothing read or stored
    (tree / "notes.txt").write_text("one\ntwo\nthree\n")
    store.take([str(tree)])
    assert reads == ["notes.txt"]


def test_a_damaged_store_fails_verify_and_restore_loudly(tree: Path, tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    sid = Store(str(store_dir)).take([str(tree)])
    obj = next(p for p in (store_dir / "objects").rglob("*") if p.is_file() and p.stat().st_size > 1000)
    obj.write_bytes(b"x" + obj.read_bytes()[1:])
    env = {"PATH": os.environ["PATH"]}
    v = subprocess.run([AGENTCELL, "snapshot", "verify", sid, "--store", str(store_dir)], capture_output=True,
                       text=True, env=env)
    assert v.returncode == 1 and "damaged" in v.stdout and "data.bin" in v.stdout, v.stdout
    r = subprocess.run([AGENTCELL, "snapshot", "restore", sid, "--store", str(store_dir)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 125 and "damaged" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    obj.unlink()
    with pytest.raises(SnapshotError, match="damaged"):
        Store(str(store_dir)).restore(sid)
    manifest = store_dir / "snapshots" / f"{sid}.json"  # the manifest itself: checked against its hash
    manifest.write_text(manifest.read_text().replace('"mode":33188', '"mode":35309', 1))
    with pytest.raises(SnapshotError, match="damaged"):
        Store(str(store_dir)).manifest(sid)


def test_an_unwritable_or_misplaced_store_is_a_clear_error(user: User, tree: Path, project: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent"}
    p = subprocess.run([*user.prefix(), AGENTCELL, "snapshot", "take", str(project), "--store", "/var/lib/ac-nope"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 125 and "--store" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    inside = subprocess.run([AGENTCELL, "snapshot", "take", str(tree), "--store", str(tree / ".store")],
                            capture_output=True, text=True)
    assert inside.returncode == 125 and "inside" in inside.stderr and not (tree / ".store").exists()
    # Below a directory an agent owns: it could rename the store away and put its own in its place.
    theirs = subprocess.run([AGENTCELL, "snapshot", "take", str(tree), "--store", str(project / "store")],
                            capture_output=True, text=True)
    assert theirs.returncode == 125 and "can be changed by others" in theirs.stderr, theirs.stderr
    assert not (project / "store").exists()


def test_a_full_disk_is_a_clear_error(tree: Path, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "agentcell-test-small", str(small)], check=True)
    try:
        p = subprocess.run([AGENTCELL, "snapshot", "take", str(tree), "--store", str(small / "store")],
                           capture_output=True, text=True)
        assert p.returncode != 0 and "No space left" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not list((small / "store" / "snapshots").glob("*.json"))  # no half snapshot to trust
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_the_cli_takes_lists_diffs_and_prunes(tree: Path, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    env = {"PATH": os.environ["PATH"]}
    first = subprocess.run([AGENTCELL, "snapshot", "take", str(tree), "--store", store], capture_output=True,
                           text=True, env=env)
    sid = first.stdout.strip().splitlines()[-1]
    assert first.returncode == 0 and Store(store).manifest(sid)["id"] == sid
    js = subprocess.run([AGENTCELL, "snapshot", "take", str(tree), "--store", store, "--json"], capture_output=True,
                        text=True, env=env)
    assert json.loads(js.stdout)["id"] != sid
    (tree / "added.txt").write_text("x\n")
    diff = subprocess.run([AGENTCELL, "snapshot", "diff", sid, "--store", store], capture_output=True, text=True,
                          env=env)
    assert f"+ {tree}/added.txt" in diff.stdout
    listed = subprocess.run([AGENTCELL, "snapshot", "list", "--store", store, "--json"], capture_output=True,
                            text=True, env=env)
    assert len(json.loads(listed.stdout)) == 2
    pruned = subprocess.run([AGENTCELL, "snapshot", "prune", "--keep", "1", "--store", store], capture_output=True,
                            text=True, env=env)
    assert pruned.returncode == 0 and len(Store(store).snapshots()) == 1
    bad = subprocess.run([AGENTCELL, "snapshot", "restore", "nosuch", "--store", store], capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 125 and bad.stderr.count("\n") == 1
