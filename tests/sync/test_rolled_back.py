"""A transaction SQLite already rolled back (a COMMIT or a statement on a full disk, an I/O
error) must surface its own error: a hand-written `except: ROLLBACK` then raised "cannot rollback -
no transaction is active" instead, which hid what happened (the same flaw
agent/store/db.py `transaction` was fixed for). The rolled-back state is made by SQLite itself: a
temporary trigger whose `RAISE(ROLLBACK, ...)` ends the whole transaction and fails the statement,
as a full disk does."""
from __future__ import annotations

import sqlite3

import pytest

from agent.runner import _adopt_private_cursors
from agent.sequencer.commit_queue import CommitQueue
from agent.sequencer.store import Store

from tests.mqtt.helpers import make_nodes


def _roll_back_on(conn: sqlite3.Connection, table: str, op: str) -> None:
    conn.execute(f"CREATE TEMP TRIGGER gone BEFORE {op} ON main.{table} "
                 "BEGIN SELECT RAISE(ROLLBACK, 'database or disk is full'); END")


def test_adopting_private_cursors_reports_the_real_error(tmp_path):
    a, b = make_nodes(tmp_path, 2)
    try:
        a.conn.execute("INSERT INTO meta VALUES (?, '7')", (f"cursor:mqtt:{b.site_id.hex()}",))
        _roll_back_on(a.conn, "meta", "DELETE")
        with pytest.raises(sqlite3.Error, match="disk is full"):
            _adopt_private_cursors(a)
        assert not a.conn.in_transaction
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("store, conn_of", [(Store, lambda s: s.conn), (CommitQueue, lambda q: q.store.conn)],
                         ids=["the_sequencer_store", "the_commit_queue"])
def test_a_sequencer_side_store_reports_the_real_error(tmp_path, store, conn_of):
    """(the Commit queue's SQL lives in its QueueStore, agent/sequencer/queue_store.py)"""
    s = store(tmp_path / "seq.db")
    try:
        _roll_back_on(conn_of(s), "events", "INSERT")
        with pytest.raises(sqlite3.Error, match="disk is full"):
            s.record_event("x", {})
        assert not conn_of(s).in_transaction
    finally:
        s.close()
