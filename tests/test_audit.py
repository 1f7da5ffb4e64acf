"""The audit trail (issue 6, part 2): a chain of whole records that no tampering gets past."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentcell.audit import AuditLog, AuditWriteError, verify
from conftest import AGENTCELL


def trail(tmp_path: Path, n: int = 6) -> Path:
    log = AuditLog(str(tmp_path / "audit" / "audit.jsonl"))
    for i in range(n):
        log.append("step", session="s-1", n=i, text="é\nline")
    return Path(log.path)


def lines(p: Path) -> list[bytes]:
    return p.read_bytes().split(b"\n")[:-1]


def test_an_untouched_trail_verifies(tmp_path: Path) -> None:
    p = trail(tmp_path)
    v = verify(str(p))
    assert v.ok and v.records == 6, v.problems
    assert oct(p.stat().st_mode & 0o777) == "0o600" and oct(p.parent.stat().st_mode & 0o777) == "0o700"
    recs = [json.loads(line) for line in lines(p)]
    assert [r["seq"] for r in recs] == list(range(1, 7)) and recs[0]["prev"] == "0" * 64
    assert recs[2]["details"] == {"n": 2, "text": "é\nline"}


def _edit(ls: list[bytes]) -> list[bytes]:
    rec = json.loads(ls[2])
    rec["details"]["n"] = 99
    return [*ls[:2], json.dumps(rec, sort_keys=True, separators=(",", ":")).encode(), *ls[3:]]


def _insert(ls: list[bytes]) -> list[bytes]:
    return [*ls[:3], ls[3], *ls[3:]]


TAMPERING = {
    "edited": (_edit, 4),  # the chain breaks at the next record, which names it
    "edited_and_rechained": (lambda ls: _edit(ls)[:3] + ls[3:], 4),
    "inserted": (_insert, 5),
    "removed": (lambda ls: ls[:2] + ls[3:], 3),
    "reordered": (lambda ls: [ls[0], ls[2], ls[1], *ls[3:]], 2),
    "truncated_at_a_record": (lambda ls: ls[:4], 4),
    "not_json": (lambda ls: [*ls[:1], b"garbage", *ls[2:]], 2),
}


@pytest.mark.parametrize("kind", sorted(TAMPERING))
def test_every_kind_of_tampering_is_found_and_placed(tmp_path: Path, kind: str) -> None:
    p = trail(tmp_path)
    change, line = TAMPERING[kind]
    p.write_bytes(b"\n".join(change(lines(p))) + b"\n")
    v = verify(str(p))
    assert not v.ok and line in [n for n, _ in v.problems], (kind, v.problems)


def test_a_part_of_the_trail_is_checked_from_where_it_began(tmp_path: Path) -> None:
    """A fleet node checks each session's part (from where the trail ended as it began), not its whole
    history: the part's records, their link to the record before it, and the anchor."""
    from agentcell.audit.trail import committed_size, records

    p = trail(tmp_path, 4)
    since = committed_size(str(p))
    log = AuditLog(str(p))
    for i in range(3):
        log.append("step", session="s-2", n=i)
    v = verify(str(p), since)
    assert v.ok and v.records == 7, v.problems
    assert [r["details"]["n"] for r in records(str(p), "s-2", since)] == [0, 1, 2]
    assert records(str(p), "s-1", since) == [] and records(str(p), "s-2", -1) == []
    assert committed_size(str(tmp_path / "none.jsonl")) == 0
    ls = lines(p)

    def edited(i: int) -> list[bytes]:  # the same length: the part still begins at ``since``
        rec = json.loads(ls[i])
        rec["details"]["n"] = 7
        return [*ls[:i], json.dumps(rec, sort_keys=True, separators=(",", ":")).encode(), *ls[i + 1:]]

    # Before the part: not read (a whole verify finds it).
    p.write_bytes(b"\n".join(edited(1)) + b"\n")
    assert verify(str(p), since).ok and not verify(str(p)).ok
    # In the part: found, at its record number; and its link to the record before it.
    for changed, line in ((ls[:5] + ls[6:], 6), (edited(5), 7), (edited(3), 5)):  # removed; edited; the link
        p.write_bytes(b"\n".join(changed) + b"\n")
        v = verify(str(p), since)
        assert not v.ok and line in [n for n, _ in v.problems], v.problems
    # A trail shorter than the part's start, or one where no record ends there.
    p.write_bytes(b"\n".join(ls[:2]) + b"\n")
    assert "shorter" in verify(str(p), since).problems[0][1]
    p.write_bytes(b"\n".join(ls) + b"\n")
    assert "no record ends" in verify(str(p), since - 3).problems[0][1]


def test_a_record_cut_in_the_middle_is_found(tmp_path: Path) -> None:
    p = trail(tmp_path)
    p.write_bytes(p.read_bytes()[:-20])
    v = verify(str(p))
    assert not v.ok and any("cut off" in why for _, why in v.problems), v.problems


def test_a_missing_anchor_is_said(tmp_path: Path) -> None:
    p = trail(tmp_path)
    Path(str(p) + ".head").unlink()
    v = verify(str(p))
    assert not v.ok and "truncation cannot be ruled out" in v.problems[0][1]


def test_concurrent_writers_make_one_chain_of_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit" / "audit.jsonl"
    code = ("import sys; from agentcell.audit import AuditLog\n"
            "log = AuditLog(sys.argv[1])\n"
            "for i in range(150): log.append('w', session=sys.argv[2], i=i, pad='x' * 3000)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), f"w{k}"]) for k in range(6)]
    assert [p.wait(120) for p in procs] == [0] * 6
    v = verify(str(path))
    assert v.ok and v.records == 900, v.problems[:3]
    per = {}
    for line in lines(path):
        rec = json.loads(line)
        per.setdefault(rec["session"], []).append(rec["details"]["i"])
    assert all(v == list(range(150)) for v in per.values())


def test_an_unwritable_trail_is_a_distinct_fatal_error(tmp_path: Path) -> None:
    d = tmp_path / "audit"
    d.mkdir()
    (d / "audit.jsonl").symlink_to("/etc/passwd")  # never followed, never written
    with pytest.raises(AuditWriteError) as e:
        AuditLog(str(d / "audit.jsonl")).append("x")
    assert e.value.exit_code == 70 and "session stops" in e.value.line()
    # Nothing of the record reached the file the link names (accounts other tests make may change it).
    assert not any(line.startswith("{") for line in Path("/etc/passwd").read_text().splitlines())


def test_a_full_disk_is_a_clear_error(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "agentcell-test-small", str(mnt)], check=True)
    try:
        log = AuditLog(str(mnt / "audit" / "audit.jsonl"))
        with pytest.raises(AuditWriteError) as e:
            for i in range(100):
                log.append("fill", big="x" * 4000, i=i)
        assert "No space left" in e.value.line() or "short write" in e.value.line(), e.value.line()
        v = verify(log.path)
        assert v.ok, v.problems  # the failed record left nothing half-written behind
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_the_cli_verifies_shows_and_tails(tmp_path: Path) -> None:
    p = trail(tmp_path)
    env = {"PATH": os.environ["PATH"]}
    ok = subprocess.run([AGENTCELL, "audit", "verify", str(p)], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and "6 records, chain intact" in ok.stdout
    shown = subprocess.run([AGENTCELL, "audit", "show", str(p), "--session", "s-1", "--json"], capture_output=True,
                           text=True, env=env)
    assert len(json.loads(shown.stdout)) == 6
    tail = subprocess.run([AGENTCELL, "audit", "tail", str(p), "-n", "2"], capture_output=True, text=True, env=env)
    assert [line.split()[0] for line in tail.stdout.splitlines()] == ["5", "6"]
    p.write_bytes(b"\n".join(_edit(lines(p))) + b"\n")
    bad = subprocess.run([AGENTCELL, "audit", "verify", str(p)], capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and f"{p}:4: does not follow record 3" in bad.stdout


def test_appending_never_buries_a_truncation(tmp_path: Path) -> None:
    p = trail(tmp_path)
    p.write_bytes(b"\n".join(lines(p)[:3]) + b"\n")  # records 4-6 cut off
    with pytest.raises(AuditWriteError, match="anchor"):
        AuditLog(str(p)).append("after")
    assert not verify(str(p)).ok and len(lines(p)) == 3


def test_a_json_line_that_is_not_a_record_is_reported_not_a_crash(tmp_path: Path) -> None:
    p = trail(tmp_path)
    ls = lines(p)
    p.write_bytes(b"\n".join([*ls[:2], b"[]", *ls[3:]]) + b"\n")
    v = verify(str(p))
    assert not v.ok and 3 in [n for n, _ in v.problems]


def test_a_trail_verified_while_others_append_is_whole_as_it_stood(tmp_path: Path) -> None:
    # Sessions on one machine append to one trail while a fleet node verifies it: the verdict is on
    # what the writers had finished (a record written but its anchor not yet is not "appended by hand").
    p = trail(tmp_path, 1)
    code = ("import sys; from agentcell.audit import AuditLog\n"
            "log = AuditLog(sys.argv[1])\n"
            "for i in range(400): log.append('step', session='s-' + sys.argv[2], n=i)\n")
    writers = [subprocess.Popen([sys.executable, "-c", code, str(p), str(w)]) for w in range(3)]
    try:
        seen = []
        while any(w.poll() is None for w in writers):
            v = verify(str(p))
            assert v.ok, v.problems
            seen.append(v.records)
    finally:
        for w in writers:
            w.wait()
    assert [w.returncode for w in writers] == [0, 0, 0]
    assert verify(str(p)).records == 1201 and len(set(seen)) > 1  # verified while it grew


@pytest.mark.parametrize("before", [0, 3])
def test_a_writer_killed_between_its_record_and_its_anchor_does_not_end_the_trail(tmp_path: Path,
                                                                                 before: int) -> None:
    # A node crashes (or a supervisor is killed) after a record's write and before its anchor's: the next
    # writer moves the anchor onto that whole, chained record, and the trail goes on verifiable.
    p = trail(tmp_path, before) if before else Path(tmp_path / "audit" / "audit.jsonl")
    code = ("import os, sys; from agentcell.audit import trail\n"
            "trail._write_head = lambda *a: os._exit(9)\n"
            "trail.AuditLog(sys.argv[1]).append('step', session='s-1', n='killed')\n")
    assert subprocess.run([sys.executable, "-c", code, str(p)]).returncode == 9
    assert len(lines(p)) == before + 1 and not verify(str(p)).ok  # the anchor is one behind
    AuditLog(str(p)).append("step", session="s-1", n="after")
    v = verify(str(p))
    assert v.ok and v.records == before + 2, v.problems
    # Only that: a record that does not follow the anchored one is still refused.
    extra = json.loads(lines(p)[-1])
    extra.update(seq=extra["seq"] + 1, prev="f" * 64)
    with p.open("ab") as f:
        f.write(json.dumps(extra, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    with pytest.raises(AuditWriteError):
        AuditLog(str(p)).append("step", session="s-1", n="refused")
