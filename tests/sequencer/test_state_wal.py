"""The sequencer state file's WAL is checkpointed at store.STATE_WAL_CHECKPOINT_PAGES (4 000 pages,
not SQLite's 1 000): each Commit writes its group's own page of the receipts index, so a longer WAL
lets a page be rewritten several times before one checkpoint copies it (docs/sequencer.md). The
WAL then reaches about that size and is reused, and the disk reserve holds room for it."""
from __future__ import annotations

import os

from agent.sequencer import service, store
from agent.sequencer.framing import encode_private_message


def test_the_wal_grows_past_sqlites_default_and_stays_within_its_checkpoint_size(tmp_path):
    service.init(tmp_path / "seq")
    wal = tmp_path / "seq" / (service.DB_NAME + "-wal")
    groups = [b"wal-group-%05d" % i for i in range(512)]
    largest = 0
    with service.Sequencer(tmp_path / "seq") as seq:
        assert seq.store.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == store.STATE_WAL_CHECKPOINT_PAGES
        assert seq.store.conn.execute("PRAGMA page_size").fetchone()[0] == store.STATE_PAGE_BYTES
        gc = seq.group_commit()
        for epoch in range(40):     # 512 groups in lockstep: each step writes ~256 index pages
            for g in groups:
                gc.put(g, encode_private_message(g, epoch, 3, ciphertext=b"c" * 32))
            for _tag, ans in gc.drain():
                assert isinstance(ans, service.Accepted), ans
            largest = max(largest, os.path.getsize(wal))
    page = store.STATE_PAGE_BYTES + 24      # a WAL frame: its header and the page
    # well past 1 000 pages and a step (the setting took), never far past 4 000: a checkpoint ran and the WAL
    # was reused (a step's transaction may end beyond the threshold before the checkpoint)
    assert 2500 * page < largest <= (store.STATE_WAL_CHECKPOINT_PAGES + 1000) * page, largest // page
    assert service.DISK_RESERVE_BYTES >= (4 << 20) + store.STATE_WAL_CHECKPOINT_PAGES * store.STATE_PAGE_BYTES

