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


def test_restore_never_makes_a_directory_through_a_project_swapped_for_a_link(tree: Path, tmp_path: Path) -> None:
    store = Store(str(tmp_path / "store"))
    sid = store.take([str(tree / "src")])  # a declared path below the project
    outside = tmp_path / "outside"
    outside.mkdir()
    tree.rename(tmp_path / "proj.old")
    tree.symlink_to(outside)  # the project's owner (not root) can do this, then ask root to restore
    with pytest.raises(SnapshotError, match="not a directory"):
        store.restore(sid)
    assert list(outside.iterdir()) == []


def test_a_directory_swapped_in_while_restore_makes_it_is_not_given_away(
        user: User, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(str(tmp_path / "store"))
    sid = store.take([str(tree)])
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, user.uid, user.gid)
    decoy = home / "decoy"  # root's, with root's file in it
    decoy.mkdir()
    (decoy / "keep").write_text("root's\n")
    real_mkdir = os.mkdir

    def racing_mkdir(path: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(path, mode, dir_fd=dir_fd)
        if dir_fd is not None and os.path.realpath(f"/proc/self/fd/{dir_fd}") == str(home):
            # What the owner of home could do between mkdir and open (renameat2 RENAME_EXCHANGE):
            os.rename(home / path, home / "made")
            os.rename(decoy, home / path)
    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    with pytest.raises(SnapshotError, match="changed while it was made"):
        store.restore(sid, to=str(home))
    monkeypatch.undo()
    swapped = home / str(tmp_path).lstrip("/").split("/")[0]
    assert swapped.stat().st_uid == 0 and (swapped / "keep").read_text() == "root's\n"


def test_restore_to_another_directory(user: User, tree: Path, tmp_path: Path) -> None:
    store = Store(str(tmp_path / "store"))
    sid = store.take([str(tree)])
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    os.chown(elsewhere, user.uid, user.gid)  # a person's directory: what the restore makes there is theirs
    store.restore(sid, to=str(elsewhere))
    assert signature(elsewhere / str(tree).lstrip("/")) == signature(tree)
    made = [elsewhere / Path(*Path(str(tree).lstrip("/")).parts[:i]) for i in range(1, len(tree.parts) - 1)]
    assert made and {(p.stat().st_uid, p.stat().st_gid) for p in made} == {(user.uid, user.gid)}


def reads_of(tree: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files a snapshot of ``tree`` reads from now on (those whose content it stores), in order."""
    reads: list[str] = []
    real = Store._put

    def counting(self: Store, opath: int, st: os.stat_result, shown: str, staging: str) -> tuple[str, int]:
        reads.append(os.path.relpath(shown, tree))
        return real(self, opath, st, shown, staging)
    monkeypatch.setattr(Store, "_put", counting)
    return reads


def test_a_second_snapshot_reads_only_what_changed(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(str(tmp_path / "store"))
    store.take([str(tree)])
    reads = reads_of(tree, monkeypatch)
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
        assert p.returncode != 0 and ("No space left" in p.stderr or "free space" in p.stderr), p.stderr
        assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
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


# ---- what a red-team pass found (each fails on the first version) --------------------------------

def test_a_file_swapped_during_the_take_keeps_its_own_owner_and_content(tree: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The walk stats "notes.txt"; an agent then exchanges it with a root-only file. The take must
    # read what it stat'ed (its fd), never the name again: root's secret must not get the agent's owner.
    secret = tree / "secret"
    secret.write_text("TOP-SECRET\n")
    secret.chmod(0o600)
    store = Store(str(tmp_path / "store"))
    real = Store._put
    swapped = []

    def swap_then_read(self: Store, opath: int, st: os.stat_result, shown: str, staging: str) -> tuple[str, int]:
        if shown.endswith("notes.txt") and not swapped:
            os.rename(tree / "notes.txt", tree / "x")
            os.rename(secret, tree / "notes.txt")
            os.rename(tree / "x", secret)
            swapped.append(1)
        return real(self, opath, st, shown, staging)
    monkeypatch.setattr(Store, "_put", swap_then_read)
    # What it opened was renamed meanwhile (its ctime moved): the take refuses rather than guess.
    with pytest.raises(SnapshotError, match="changed while it was snapshotted"):
        store.take([str(tree)])
    assert swapped and store.snapshots() == []


def test_acls_an_agent_added_do_not_survive_a_restore(user: User, tree: Path, tmp_path: Path) -> None:
    subprocess.run(["setfacl", "-m", "u:nobody:r", str(tree / "notes.txt")], check=True)  # the user's own
    store = Store(str(tmp_path / "store"))
    before = _acls(tree)
    sid = store.take([str(tree)])
    r = agentcell_run(["--as", str(user.uid), "--rw", str(tree), "--", "sh", "-c",
                       f"setfacl -m u:{user.uid}:rwx,d:u:{user.uid}:rwx {tree} {tree}/src && "
                       f"setfacl -x u:nobody {tree}/notes.txt"])
    assert r.rc == 0, r.err
    store.restore(sid)
    assert _acls(tree) == before


def _acls(tree: Path) -> list[str]:
    """Each file's ACL (getfacl -R, links not followed), in the order of the names: a restore makes the files
    anew, and a directory lists its entries in an order of its filesystem's (tmpfs: the newest first)."""
    out = subprocess.run(["getfacl", "-R", "-P", "-p", str(tree)], capture_output=True, text=True).stdout
    return sorted(out.strip().split("\n\n"))


def test_a_tree_too_deep_to_walk_is_refused_not_cut(tree: Path, tmp_path: Path) -> None:
    d = tree
    for _ in range(400):
        d = d / "d"
    d.mkdir(parents=True)
    p = subprocess.run(["prlimit", "--nofile=256:256", AGENTCELL, "snapshot", "take", str(tree), "--store",
                        str(tmp_path / "store")], capture_output=True, text=True)
    assert p.returncode == 125 and "deeper than" in p.stderr, p.stderr
    assert not list((tmp_path / "store" / "snapshots").glob("*.json"))


def test_diff_output_carries_no_terminal_escapes(tree: Path, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    sid = Store(store).take([str(tree)])
    (tree / "x\x1b[2K\x1b[1A").write_text("hidden\n")
    (tree / "notes.txt").write_text("one\n\x1b]52;c;AAAA\x07\n")
    out = subprocess.run([AGENTCELL, "snapshot", "diff", sid, "--store", store], capture_output=True, text=True).stdout
    assert "\x1b" not in out and "\\x1b" in out, out


def test_a_manifest_naming_a_way_out_is_refused(tree: Path, tmp_path: Path) -> None:
    store = Store(str(tmp_path / "store"))
    sid = store.take([str(tree)])
    path = tmp_path / "store" / "snapshots" / f"{sid}.json"
    m = json.loads(path.read_text())
    real = next(e for e in m["roots"][str(tree)]["entries"] if "sha" in e)  # content the store has
    m["roots"][str(tree)]["entries"].append({**real, "p": b"../escape".hex()})
    raw = json.dumps(m, separators=(",", ":")).encode()
    path.write_bytes(raw)
    (tmp_path / "store" / "snapshots" / f"{sid}.sha256").write_text(hashlib.sha256(raw).hexdigest())
    with pytest.raises(SnapshotError, match="not a path inside its root"):
        store.restore(sid)
    assert not (tree.parent / "escape").exists()


def test_a_share_granted_and_revoked_leaves_only_what_its_agent_changed_to_read(
        user: User, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's ACL grant and revoke move every file's ctime; Store.carry keeps the store's knowledge of
    the files whose content cannot have changed, so the next backup reads what the agent wrote, and only
    that, and still restores every byte."""
    from agentcell.accounts import acl
    from agentcell.accounts.commands import Commands

    old = 1_600_000_000
    for p in tree.rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.utime(p, (old, old))  # written long ago: no write in the same tick can hide behind the mtime
    files = sorted(os.path.relpath(p, tree) for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
    store = Store(str(tmp_path / "store"))
    store.take([str(tree)])
    agent_gid = 1_900_065_000  # (an ACL entry may name a group that does not exist)
    granted: list[tuple[str, os.stat_result, os.stat_result]] = []
    acl.grant(Commands(), "agentcell-x", agent_gid, str(tree), "rw", changed=lambda *c: granted.append(c))
    assert sorted(rel for rel, _, _ in granted) == files
    (tree / "notes.txt").write_text("one\ntwo\nchanged by the agent\n")  # (a write: mtime and ctime move)
    revoked: list[tuple[str, os.stat_result, os.stat_result]] = []
    acl.revoke(Commands(), 1_900_065_000, agent_gid, str(tree), [], changed=lambda *c: revoked.append(c))
    # As a session's cleanup does: the grant's changes, then the revoke's, in one rewrite of the cache.
    assert store.carry(str(tree), granted + revoked, {user.uid}) == 2 * len(files) - 1  # notes.txt: the grant only
    reads = reads_of(tree, monkeypatch)
    sid = store.take([str(tree)])
    assert reads == ["notes.txt"]
    before = signature(tree)
    for rel in files:
        (tree / rel).write_bytes(b"overwritten")
    store.restore(sid)
    assert signature(tree) == before


def test_carry_keeps_nothing_whose_content_could_have_changed(user: User, tree: Path, tmp_path: Path) -> None:
    old = 1_600_000_000
    for name in ("notes.txt", "script.sh"):
        os.utime(tree / name, (old, old))
    store = Store(str(tmp_path / "store"))
    store.take([str(tree)])
    notes, script, main = (os.stat(tree / n) for n in ("notes.txt", "script.sh", "src/main.py"))
    (tree / "notes.txt").write_text("one\ntwo\nthree\n")  # content changed between the two stats
    os.chmod(tree / "script.sh", 0o755)  # only the ctime moved...
    os.chmod(tree / "src/main.py", 0o644)  # ...as here, but its mtime is too recent to tell a write in its tick
    changes = [(n, st, os.stat(tree / n)) for n, st in (("notes.txt", notes), ("script.sh", script),
                                                         ("src/main.py", main))]
    assert store.carry(str(tree), changes, {user.uid + 1}) == 0  # the owner could set the mtime back: not ours
    assert store.carry(str(tree), changes, {user.uid}) == 1  # script.sh only
