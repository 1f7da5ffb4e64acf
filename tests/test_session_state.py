"""The checkpoint database as many sessions reach it at once (a fleet node's, a batch of `session start`)."""
from __future__ import annotations

import multiprocessing
import os
import sqlite3
from pathlib import Path

import pytest


def _first_use(state: str, ready: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue[str]) -> None:
    os.environ["AGENTCELL_STATE_DIR"] = state
    from agentcell.session.state import connect

    ready.wait()
    try:
        conn = connect()
        conn.execute("CREATE TABLE IF NOT EXISTS t (x)")  # (as the checkpointer's set-up does)
        conn.execute("INSERT INTO t VALUES (1)")
        conn.commit()
        conn.close()
        out.put("")
    except sqlite3.Error as e:
        out.put(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("trial", range(12))
def test_sessions_that_open_a_fresh_database_at_once_all_get_it(tmp_path: Path, trial: int) -> None:
    """Eight processes open a new database at the same moment: each gets it, and it is WAL. (Before the
    fix about one open in thirty failed at once with "database is locked": the switch to WAL, which the
    busy timeout does not cover, was raced by every first connection.)"""
    ctx = multiprocessing.get_context("fork")
    ready, out = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_first_use, args=(str(tmp_path), ready, out)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    said = [out.get(timeout=10) for _ in procs]
    assert [p.exitcode for p in procs] == [0] * 8
    assert [s for s in said if s] == []
    db = tmp_path / "sessions" / "checkpoints.sqlite"
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 8


def test_a_checkpoint_that_names_a_class_constructs_nothing_when_read_back() -> None:
    """LangGraph's default serializer imports and calls whatever class or function a checkpoint names; ours
    reads such an entry back as its plain data (a forged database must not run code as root on load)."""
    import signal

    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    from agentcell.session.state import Serde

    forged = JsonPlusSerializer(allowed_msgpack_modules=True).dumps_typed({"x": signal.Signals.SIGTERM})
    loose = JsonPlusSerializer(allowed_msgpack_modules=True).loads_typed(forged)  # (LangGraph's default)
    assert type(loose["x"]) is signal.Signals, loose  # it called signal.Signals(15), as it would os.system(...)
    back = Serde().loads_typed(forged)
    assert type(back["x"]) is not signal.Signals and back["x"] == 15, back
    assert Serde().loads_typed(Serde().dumps_typed({"when": {1, 2}, "s": "x"})) == {"when": {1, 2}, "s": "x"}
