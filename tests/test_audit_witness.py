"""A trail a later root cannot rewrite unseen (issue 30): RFC 6962 trees, a forward-secure key chain,
heads sent to a witness off the host, and ``audit verify --witness`` naming the first record a root
changed after it was sealed. The witness of the root tests is the real reference server, run by
another user in a network namespace of the test's own."""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentcell.audit import AuditLog, merkle, seal
from agentcell.audit.witnessed import check
from conftest import AGENTCELL, User
from sessionkit import Env, records, scripted

# ---- RFC 6962 known answers (the Certificate Transparency reference vectors, as transparency-dev/merkle's
# testonly/constants.go and proof/verify_test.go publish them) ---------------------------------------

INPUTS = ["", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f"]
ROOTS = ["e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
         "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
         "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
         "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
         "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
         "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
         "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
         "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
         "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"]
INCLUSION = [  # (leaf index, tree size, path)
    (0, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (5, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (1, 5, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]
CONSISTENCY = [  # (old size, new size, proof)
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 5, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
    (6, 7, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
]
LEAVES = [merkle.leaf_hash(bytes.fromhex(x)) for x in INPUTS]


def test_tree_roots_are_rfc_6962s() -> None:
    assert [merkle.root(LEAVES[:n]).hex() for n in range(9)] == ROOTS


@pytest.mark.parametrize(("index", "size", "path"), INCLUSION)
def test_inclusion_proofs_are_the_reference_ones_and_nothing_else_verifies(index: int, size: int,
                                                                           path: list[str]) -> None:
    proof = merkle.inclusion_proof(index, size, merkle.over(LEAVES[:size]))
    assert [p.hex() for p in proof] == path
    root = bytes.fromhex(ROOTS[size])
    assert merkle.verify_inclusion(index, size, LEAVES[index], proof, root)
    wrong = [(index ^ 1, size, LEAVES[index], proof), (index, size * 2, LEAVES[index], proof),
             (index, size, LEAVES[index - 1], proof), (index, size, LEAVES[index], [*proof, root]),
             (index, size, LEAVES[index], proof[:-1]), (index, size, LEAVES[index], [root, *proof])]
    wrong += [(index, size, LEAVES[index], [*proof[:i], bytes([proof[i][0] ^ 8]) + proof[i][1:], *proof[i + 1:]])
              for i in range(len(proof))]
    assert not any(merkle.verify_inclusion(i, n, leaf, p, root) for i, n, leaf, p in wrong)


@pytest.mark.parametrize(("old", "size", "path"), CONSISTENCY)
def test_consistency_proofs_are_the_reference_ones_and_nothing_else_verifies(old: int, size: int,
                                                                             path: list[str]) -> None:
    proof = merkle.consistency_proof(old, size, merkle.over(LEAVES[:size]))
    assert [p.hex() for p in proof] == path
    r1, r2 = bytes.fromhex(ROOTS[old]), bytes.fromhex(ROOTS[size])
    assert merkle.verify_consistency(old, size, r1, r2, proof)
    wrong = [(old - 1, size, r1, r2, proof), (old + 1, size, r1, r2, proof), (old, size * 2, r1, r2, proof),
             (old, size, r2, r1, proof), (old, size, r1, r2, []), (old, size, r1, r2, proof[:-1]),
             (old, size, r1, r2, [*proof, r1]), (old, size, r1, r2, [proof[0], *proof])]
    wrong += [(old, size, r1, r2, [*proof[:i], bytes([proof[i][0] ^ 16]) + proof[i][1:], *proof[i + 1:]])
              for i in range(len(proof))]
    assert not any(merkle.verify_consistency(*w) for w in wrong)


def test_the_sealers_compact_view_proves_what_the_whole_tree_does() -> None:
    # The sealer keeps O(log n) hashes, not the trail's leaves: its proofs must be the RFC's all the same.
    leaves = [merkle.leaf_hash(b"record %d" % i) for i in range(40)]
    for n in range(1, 41):
        root = merkle.root(leaves[:n])
        for i in range(n):
            assert merkle.verify_inclusion(i, n, leaves[i], merkle.inclusion_proof(i, n, merkle.over(leaves)), root)
        for m in range(1, n + 1):
            old = merkle.CompactRange()
            old.extend(leaves[:m])
            proof = merkle.consistency_proof(m, n, merkle.extended(old, leaves[m:n]))
            assert proof == merkle.consistency_proof(m, n, merkle.over(leaves[:n]))
            assert merkle.verify_consistency(m, n, old.root(), root, proof)


# ---- a sealed trail, its witness a file --------------------------------------------------------

def sealed(tmp_path: Path, n: int = 10, every: int = 4) -> tuple[AuditLog, str, str]:
    """A trail sealed to a file witness with ``n`` records after its ``audit.seal``; (log, witness, key)."""
    log = AuditLog(str(tmp_path / "audit" / "audit.jsonl"))
    for i in range(3):
        log.append("before", session="s-0", i=i)
    witness = f"file:{tmp_path / 'witness' / 'heads.jsonl'}"
    (tmp_path / "witness").mkdir()
    key, problem = log.seal_to(witness, every, 3600)
    assert problem is None and key.startswith("ed25519:")
    for i in range(n):
        log.append("step", session="s-1", i=i)
    assert log.seal() is None
    return log, witness, key


def lines(path: str) -> list[bytes]:
    return Path(path).read_bytes().split(b"\n")[:-1]


def write_rechained(path: str, recs: list[dict[str, Any]]) -> None:
    """What a root with the file can do: write records and recompute every hash of the chain and its anchor."""
    prev, out = "0" * 64, []
    for r in recs:
        r = {**r, "prev": prev}
        line = json.dumps(r, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
        out.append(line)
        prev = hashlib.sha256(line).hexdigest()
    Path(path).write_bytes(b"\n".join(out) + b"\n")
    Path(path + ".head").write_bytes(f"{len(out)} {prev}\n".encode().ljust(128))


def test_a_sealed_trail_matches_its_witness_and_each_head_signs_once(tmp_path: Path) -> None:
    log, witness, key = sealed(tmp_path)
    w = check(log.path, witness, key)
    assert w.ok and w.records == 14 and w.sealed == 14, w.problems
    heads = [json.loads(line) for line in Path(witness[5:]).read_bytes().splitlines()]
    # Batches of at most 4 records; each head signed by the key the one before named; epoch 0's is the key.
    assert [h["epoch"] for h in heads] == list(range(len(heads))) and all(h["size"] - h["from"] <= 4 for h in heads)
    assert heads[0]["key"] == key.removeprefix("ed25519:")
    assert all(a["next_key"] == b["key"] for a, b in zip(heads, heads[1:], strict=False))
    assert len({h["key"] for h in heads}) == len(heads)
    # What the host keeps is the next epoch's key only.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    current = Path(seal.seal_dir(log.path), "state").read_bytes().split(b"\n")[1].decode()
    public = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(current)).public_key().public_bytes_raw().hex()
    assert public == heads[-1]["next_key"] and public not in {h["key"] for h in heads}
    assert [r["event"] for r in map(json.loads, lines(log.path))][3] == "audit.seal"


def test_concurrent_writers_on_a_sealed_trail_make_one_witnessed_log(tmp_path: Path) -> None:
    import sys

    log, witness, key = sealed(tmp_path, n=0, every=8)
    code = ("import sys; from agentcell.audit import AuditLog\n"
            "log = AuditLog(sys.argv[1])\n"
            "for i in range(60): log.append('w', session=sys.argv[2], i=i)\n"
            "assert log.witness_problem is None\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, log.path, f"w{k}"]) for k in range(4)]
    assert [p.wait(120) for p in procs] == [0] * 4
    assert log.seal() is None
    w = check(log.path, witness, key)
    assert w.ok and w.records == w.sealed == 244, w.problems
    heads = [json.loads(line) for line in Path(witness[5:]).read_bytes().splitlines()]
    assert [h["epoch"] for h in heads] == list(range(len(heads)))  # delivered once each, in order


def test_the_previous_epochs_key_is_overwritten_where_it_lay(tmp_path: Path) -> None:
    log, _witness, _key = sealed(tmp_path, n=1)
    state = os.path.join(seal.seal_dir(log.path), "state")
    held = os.open(state, os.O_RDONLY)  # the file that holds this epoch's key, as a thief with an fd would
    try:
        before = os.pread(held, 1 << 16, 0)
        assert before.split(b"\n")[1] and before.strip(b"\0")
        log.append("next", session="s-1")
        assert log.seal() is None
        after = os.pread(held, 1 << 16, 0)
        assert after == b"\0" * len(before)  # the old epoch's key: zeros, though its name is gone
        assert os.fstat(held).st_nlink == 0
    finally:
        os.close(held)


@pytest.mark.parametrize("kind", ["truncated", "rewritten", "rechained", "rewritten_and_rechained_in_the_tail"])
def test_a_root_who_changes_the_sealed_trail_is_caught_and_the_first_bad_record_named(tmp_path: Path,
                                                                                    kind: str) -> None:
    log, witness, key = sealed(tmp_path)
    recs = [json.loads(line) for line in lines(log.path)]
    if kind == "truncated":
        write_rechained(log.path, recs[:9])
        first, words = 10, "records 10-14 are missing"
    elif kind == "rewritten":  # one record changed in place; the chain is left as it is
        ls = lines(log.path)
        rec = json.loads(ls[5])
        rec["details"]["i"] = 99
        ls[5] = json.dumps(rec, sort_keys=True, separators=(",", ":")).encode()
        Path(log.path).write_bytes(b"\n".join(ls) + b"\n")
        first, words = 6, "record 6 is not the one"
    elif kind == "rechained":  # the plain verify sees nothing: the chain and its anchor are recomputed
        recs[7]["event"] = "harmless"
        write_rechained(log.path, recs)
        first, words = 8, "record 8 is not the one"
    else:
        recs[12]["details"] = {}
        write_rechained(log.path, recs)
        first, words = 13, "record 13 is not the one"
    plain = subprocess.run([AGENTCELL, "audit", "verify", log.path], capture_output=True, text=True)
    assert plain.returncode == (1 if kind == "rewritten" else 0), plain.stdout
    p = subprocess.run([AGENTCELL, "audit", "verify", log.path, "--witness", witness, "--key", key],
                       capture_output=True, text=True)
    assert p.returncode == 1 and f"{log.path}:{first}: {words}" in p.stdout, p.stdout + p.stderr


def test_a_stolen_key_cannot_sign_an_earlier_epoch(tmp_path: Path) -> None:
    # A root takes the host now: it has the current epoch's key and the whole disk. It rewrites record 5
    # (sealed in epoch 1), re-chains, and signs a head for epoch 1 to match, and one for the current epoch.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    log, witness, key = sealed(tmp_path)
    store = Path(witness[5:])
    heads = [json.loads(line) for line in store.read_bytes().splitlines()]
    stolen = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(
        Path(seal.seal_dir(log.path), "state").read_bytes().split(b"\n")[1].decode()))
    recs = [json.loads(line) for line in lines(log.path)]
    recs[4]["details"] = {"forged": True}
    write_rechained(log.path, [*recs, {**recs[-1], "seq": 15, "event": "forged.end"}])
    leaves = [merkle.leaf_hash(line) for line in lines(log.path)]

    def forged(epoch: int, frm: int, size: int) -> dict[str, Any]:
        old = merkle.CompactRange()
        old.extend(leaves[:frm])
        h = {"agentcell_head": 1, "log": heads[0]["log"], "epoch": epoch, "from": frm, "size": size,
             "root": merkle.root(leaves[:size]).hex(), "ts": time.time(),
             "key": stolen.public_key().public_bytes_raw().hex(), "next_key": "00" * 32,
             "proof": [p.hex() for p in merkle.consistency_proof(frm, size, merkle.extended(old, leaves[frm:size]))]
             if frm else [], "leaves": [x.hex() for x in leaves[frm:size]]}
        h["sig"] = stolen.sign(seal.signed_bytes(h)).hex()
        return h

    h1 = heads[1]
    with store.open("ab") as f:  # whoever can write to the witness adds them
        f.write(json.dumps(forged(1, h1["from"], h1["size"])).encode() + b"\n")
        # The stolen key is the current epoch's: its head is signed, but cannot extend the witnessed past.
        f.write(json.dumps(forged(len(heads), heads[-1]["size"], len(leaves))).encode() + b"\n")
    w = check(log.path, witness, key)
    problems = " | ".join(p for _, p in w.problems)
    assert "epoch 1 that epoch 1's key did not sign" in problems, problems
    assert f"the head of epoch {len(heads)} (records 15-15) is signed, but its consistency proof" in problems
    assert any(n == 5 and "record 5 is not the one" in p for n, p in w.problems), w.problems
    assert w.sealed == 14


def test_two_heads_for_one_epoch_mean_its_key_was_taken(tmp_path: Path) -> None:
    log, witness, key = sealed(tmp_path, n=4)
    state = Path(seal.seal_dir(log.path), "state")
    copy = state.read_bytes()  # a thief's copy of the current key, made before the host seals again
    log.append("honest", session="s-1")
    assert log.seal() is None
    os.replace(state, state.with_suffix(".honest"))
    state.write_bytes(copy)  # the thief, root now, puts the copy back: the sealer is at that epoch again
    os.chmod(state, 0o600)
    Path(seal.seal_dir(log.path), "sent").write_text("1\n")
    write_rechained(log.path, [json.loads(line) for line in lines(log.path)][:-1])
    AuditLog(log.path).append("forged", session="s-1")
    assert seal.seal(log.path, force=True)  # the same epoch, signed again over a different record
    assert seal.deliver(log.path) is None
    w = check(log.path, witness, key)
    assert any("was signed twice with different heads" in p for _, p in w.problems), w.problems


def test_a_head_missing_at_the_witness_is_said_and_what_follows_is_not_trusted(tmp_path: Path) -> None:
    log, witness, key = sealed(tmp_path)
    store = Path(witness[5:])
    kept = store.read_bytes().splitlines()
    store.write_bytes(b"\n".join([kept[0], *kept[2:]]) + b"\n")
    w = check(log.path, witness, key)
    assert not w.ok and w.sealed == json.loads(kept[0])["size"]
    assert any("holds no head of epoch 1" in p for _, p in w.problems), w.problems


def test_a_witness_that_is_down_gets_the_queued_heads_in_order_when_it_is_back(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "audit" / "audit.jsonl"))
    d = tmp_path / "witness"
    d.mkdir()
    key, problem = log.seal_to(f"file:{d / 'heads.jsonl'}", 2, 3600)
    assert problem is None
    shutil.rmtree(d)  # the witness's mount is gone
    for i in range(5):
        log.append("step", i=i)
    assert log.witness_problem and "did not take the head of epoch 1" in log.witness_problem
    st = seal.status(log.path)
    assert st is not None and [e for e, _, _ in st.undelivered] == [1, 2] and st.problem
    d.mkdir()
    assert log.seal() is None
    st = seal.status(log.path)
    assert st is not None and not st.undelivered and st.problem is None
    epochs = [json.loads(line)["epoch"] for line in (d / "heads.jsonl").read_bytes().splitlines()]
    assert epochs == [1, 2, 3]  # (epoch 0 reached the first witness file, gone with its mount)
    w = check(log.path, f"file:{d / 'heads.jsonl'}", key)
    assert any("no head of epoch 0" in p for _, p in w.problems)


def test_records_after_the_last_head_are_said_and_accepted_only_while_running(tmp_path: Path) -> None:
    log, witness, key = sealed(tmp_path)
    log.append("latest", session="s-1")  # not due yet: every 4 records, and an hour
    w = check(log.path, witness, key)
    assert [n for n, _ in w.problems] == [15] and "not covered by a head the witness holds" in w.problems[0][1]
    w = check(log.path, witness, key, running=True)
    assert w.ok and w.notes


@pytest.mark.parametrize("kind", ["syslog", "syslog+tcp"])
def test_a_syslog_witness_gets_rfc_5424_lines_that_verify_as_its_server_stores_them(tmp_path: Path,
                                                                                    kind: str) -> None:
    # The syslog server is a socket of the test's own on loopback that stores each message as rsyslog's
    # file output would: one line each, its header before the head.
    udp = kind == "syslog"
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    if not udp:
        srv.listen(8)
    srv.settimeout(0.1)
    got: list[bytes] = []
    done = False

    def receive() -> None:
        while not done:
            try:
                if udp:
                    got.append(srv.recv(65536))
                    continue
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
                length, _, rest = data.partition(b" ")  # RFC 6587 octet counting
                assert int(length) == len(rest)
                got.append(rest)

    import threading

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    try:
        log = AuditLog(str(tmp_path / "audit" / "audit.jsonl"))
        key, problem = log.seal_to(f"{kind}://127.0.0.1:{srv.getsockname()[1]}", 4, 3600)
        for i in range(9):
            log.append("step", i=i)
        assert problem is None and log.seal() is None
        deadline = time.monotonic() + 10
        while len(got) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        done = True
        t.join(10)
        srv.close()
    assert len(got) == 4 and all(m.startswith(b"<85>1 ") and b" agentcell " in m and b" tree-head - {" in m
                                 for m in got), got[:1]
    stored = tmp_path / "syslog.log"
    stored.write_bytes(b"".join(b"Dec  6 03:40:00 witness " + m + b"\n" for m in got))
    w = check(log.path, f"file:{stored}", key)
    assert w.ok and w.sealed == 10, w.problems


def test_the_reference_witness_keeps_heads_only_and_serves_them_back(tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = tmp_path / "heads.jsonl"
    proc = subprocess.Popen([AGENTCELL, "audit", "witness", "serve", "--listen", f"127.0.0.1:{port}", "--store",
                             str(store)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
                time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def post(body: bytes, path: str = "/heads") -> int:
            try:
                with opener.open(urllib.request.Request(base + path, data=body, method="POST"), timeout=10) as r:
                    return int(r.status)
            except urllib.error.HTTPError as e:
                return e.code

        assert post(b"not json") == 400 and post(b'{"other": 1}') == 400 and post(b'[1]') == 400
        assert post(b'{"agentcell_head": 1, "epoch": 0}', "/elsewhere") == 404
        assert post(b'{"agentcell_head": 1, "epoch": 0}') == 201 == post(b'{"epoch": 1, "agentcell_head": 1}')
        with opener.open(base + "/heads", timeout=10) as r:
            served = r.read()
        assert served == store.read_bytes() == b'{"agentcell_head":1,"epoch":0}\n{"agentcell_head":1,"epoch":1}\n'
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    log, witness, key = sealed(tmp_path, n=1)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([AGENTCELL, "audit", *args], capture_output=True, text=True)

    for args, words in [(("verify", log.path, "--witness", witness), "--witness needs --key"),
                        (("verify", log.path, "--witness", witness, "--key", "ed25519:zz"), "is not a trail's key"),
                        (("verify", log.path, "--witness", "ftp://x", "--key", key), "not a kind of witness"),
                        (("verify", log.path, "--witness", "syslog://127.0.0.1", "--key", key),
                         "cannot be read back over syslog"),
                        (("verify", log.path, "--witness", f"file:{tmp_path}/none", "--key", key), "does not exist"),
                        (("init", log.path, "--witness", witness), "is sealed already"),
                        (("init", str(tmp_path / "t2"), "--witness", "relative/path"), "names no witness"),
                        (("init", str(tmp_path / "t3"), "--witness", witness, "--every", "0"),
                         "--every: 0 is not between"),
                        (("seal", str(tmp_path / "t4")), "is not sealed")]:
        p = cli(*args)
        assert p.returncode != 0 and words in p.stderr and len(p.stderr.strip().splitlines()) == 1, \
            (args, p.stdout, p.stderr)


def test_without_a_witness_verify_says_what_the_chain_does_not_prove(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "audit" / "audit.jsonl"))
    log.append("x")
    p = subprocess.run([AGENTCELL, "audit", "verify", log.path], capture_output=True, text=True)
    assert p.returncode == 0 and "a root can rewrite the file and recompute the chain" in p.stdout, p.stdout


def test_sealing_is_not_on_agentcell_runs_path() -> None:
    code = ("import sys; sys.argv = ['agentcell', 'run', '--as', '65534', '--', 'true']\n"
            "import agentcell.cli.main, agentcell.cli.run, agentcell.cell.launch, agentcell.supervise\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cryptography' or m.startswith("
            "'agentcell.audit')))")
    import sys

    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr


# ---- as root: a real witness, another user's, in a network namespace of its own ---------------

class NetnsWitness:
    """``agentcell audit witness serve`` as ``user``, in namespace agentcell-wit-<tag> behind a veth pair
    (ac-wh<tag> on the host, ac-wn<tag> inside), on an address of the benchmark range 198.19.0.0/16 that
    only the pair routes; its store in a directory only that user can write."""

    def __init__(self, user: User) -> None:
        tag = secrets.token_hex(3)
        self.ns, self.host_if, self.ns_if = f"agentcell-wit-{tag}", f"ac-wh{tag}", f"ac-wn{tag}"
        net = 4 * secrets.randbelow(60)
        self.host_addr, self.addr = f"198.19.251.{net + 1}", f"198.19.251.{net + 2}"
        self.dir = Path("/tmp") / f"agentcell-wit-{tag}"
        self.store = self.dir / "heads.jsonl"
        self.url = f"http://{self.addr}:8788"
        self.user = user
        self.proc: subprocess.Popen[str] | None = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def _build(self) -> None:
        self.dir.mkdir(mode=0o700)
        os.chown(self.dir, self.user.uid, self.user.gid)
        self._ip("netns", "add", self.ns)
        self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._ip("link", "set", self.ns_if, "netns", self.ns)
        self._ip("addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
        self._ip("link", "set", self.host_if, "up")
        self._ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        self._ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.addr}/30", "dev", self.ns_if)
        self._ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *self.user.prefix(), AGENTCELL, "audit",
                                      "witness", "serve", "--listen", f"{self.addr}:8788", "--store", str(self.store)],
                                     stderr=subprocess.PIPE, text=True, env={"PATH": os.environ["PATH"]})
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection((self.addr, 8788), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the witness does not answer: {self.proc.stderr and self.proc.stderr.read()}") \
                        from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # the PID we started: ip netns exec and setpriv exec in place
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def witness(user: User) -> Iterator[NetnsWitness]:
    w = NetnsWitness(user)
    try:
        yield w
    finally:
        w.close()
        assert subprocess.run(["ip", "link", "show", w.host_if], capture_output=True).returncode != 0
        assert w.ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


STEPS = "edit {p}/src/app.py 'x = 1' 'x = 2'\nwrite {p}/src/new.py 'print(1)'\n"


def test_a_root_who_rewrites_a_sessions_trail_afterwards_is_caught_by_the_witness(env: Env,
                                                                                   witness: NetnsWitness) -> None:
    s = scripted(env, STEPS.format(p=env.project), "--rw", "src", "--wall-clock", "2", "--audit-witness",
                 witness.url, "--audit-witness-required")
    assert s.rc == 0 and s.summary["status"] == "completed" and not s.summary["audit_error"], (s.err, s.summary)
    key = s.err.split("needs (keep it off this host): ")[1].split()[0]
    sid = s.summary["session"]
    assert records(env, sid)[-1]["event"] == "session.end"
    stored = witness.store.read_bytes().splitlines()
    assert stored and witness.store.stat().st_uid == witness.user.uid
    trail = str(env.audit)
    verify = [AGENTCELL, "audit", "verify", trail, "--witness", witness.url, "--key", key]
    p = subprocess.run(verify, capture_output=True, text=True)
    assert p.returncode == 0 and "match them" in p.stdout, p.stdout + p.stderr
    n = len(lines(trail))
    original, anchor = Path(trail).read_bytes(), Path(trail + ".head").read_bytes()
    end = next(i for i, r in enumerate(map(json.loads, lines(trail)), 1) if r["event"] == "session.end")
    for kind in ("truncate", "rewrite", "rechain"):
        recs = [json.loads(line) for line in lines(trail)]
        if kind == "truncate":  # the session's last records cut off, the anchor set to match
            write_rechained(trail, recs[:end - 3])
            want = f"{trail}:{end - 2}: records {end - 2}-{n} are missing"
        elif kind == "rewrite":  # the ending changed in place
            ls = lines(trail)
            rec = json.loads(ls[end - 1])
            rec["details"]["status"] = "terminated"
            ls[end - 1] = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
            Path(trail).write_bytes(b"\n".join(ls) + b"\n")
            want = f"{trail}:{end}: record {end} is not the one"
        else:  # the plan made to look narrower, and every hash after it recomputed
            plan = next(i for i, r in enumerate(recs) if r["event"] == "session.plan")
            recs[plan]["details"]["declared_paths"] = []
            write_rechained(trail, recs)
            assert subprocess.run([AGENTCELL, "audit", "verify", trail], capture_output=True).returncode == 0
            want = f"{trail}:{plan + 1}: record {plan + 1} is not the one"
        p = subprocess.run(verify, capture_output=True, text=True)
        assert p.returncode == 1 and want in p.stdout, (kind, p.stdout, p.stderr)
        Path(trail).write_bytes(original)
        Path(trail + ".head").write_bytes(anchor)
    assert subprocess.run(verify, capture_output=True).returncode == 0


def test_a_witness_that_is_down_stops_a_session_that_requires_it_and_not_one_that_does_not(
        env: Env, witness: NetnsWitness) -> None:
    s = scripted(env, f"write {env.project}/src/a.txt 1\n", "--rw", "src", "--wall-clock", "2",
                 "--audit-witness", witness.url)
    assert s.rc == 0, s.err
    key = s.err.split("needs (keep it off this host): ")[1].split()[0]
    witness.stop()
    # Required: refused before anything exists (no cell, no account), one line saying why.
    s = scripted(env, f"write {env.project}/src/b.txt 1\n", "--rw", "src", "--wall-clock", "2",
                 "--audit-witness-required")
    assert s.rc != 0 and "--audit-witness-required" in s.err and not (env.project / "src" / "b.txt").exists(), s.err
    # Not required: the session runs, and its summary says the witness missed heads, which wait here.
    s = scripted(env, f"write {env.project}/src/c.txt 1\n", "--rw", "src", "--wall-clock", "2")
    assert s.rc == 0 and (env.project / "src" / "c.txt").exists()
    assert any("witness did not take every head" in w for w in s.summary["warnings"]), s.summary
    st = seal.status(str(env.audit))
    assert st is not None and st.undelivered
    witness.start()
    p = subprocess.run([AGENTCELL, "audit", "seal", str(env.audit)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    p = subprocess.run([AGENTCELL, "audit", "verify", str(env.audit), "--witness", witness.url, "--key", key],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
