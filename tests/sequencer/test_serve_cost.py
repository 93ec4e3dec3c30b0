"""What one answered batch costs `sequencer run` does not grow with the gaps it ever recorded.

Before: after every answered batch of submits (and every submit request), the server read every
recorded discontinuity, with its Commit bytes, to find the ones not yet published: after a rollback
that recorded thousands of gaps, each Commit answered cost a scan of all of them. Now it reads only
the rows recorded since it last looked, and looks again only at the gaps still waiting for their
signed statement. Counted in SQLite virtual-machine instructions (the progress handler), not time.
"""
from __future__ import annotations

from agent.sequencer import service
from agent.sequencer.framing import encode_private_message
from test_hostile_requests import msg, server
from test_queue_cost import count_instructions

G = bytes.fromhex("c0" * 16)
GAPPED = bytes.fromhex("9a" * 16)


def with_gaps(tmp_path, name: str, n: int) -> service.Sequencer:
    home = tmp_path / name
    service.init(home)
    s = service.Sequencer(home)
    # gaps taken over from another sequencer (recovered): published as they are, nothing to sign
    s.store.commit_settled([], [], [(GAPPED, e, bytes(32), b"commit %d" % e, "recovered") for e in range(n)], [], [])
    s.register(G, 0)
    return s


def instructions_per_commit(s: service.Sequencer, commits: int = 5) -> tuple[int, list]:
    srv, answers = server(s)
    srv._publish_discontinuities()          # what start() publishes before serving
    published = list(srv.client.published)

    def submit_all() -> None:
        for e in range(commits):
            srv.handle_many([msg(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, e), mid=e + 1)])
    n = count_instructions(s.store.conn, submit_all)
    assert [a["accepted"] for a in answers] == [True] * commits, answers
    return n // commits, published


def test_an_answered_commit_costs_the_same_with_2000_recorded_gaps_as_with_10(tmp_path):
    small, big = with_gaps(tmp_path, "small", 10), with_gaps(tmp_path, "big", 2000)
    try:
        few, published_few = instructions_per_commit(small)
        many, published_many = instructions_per_commit(big)
    finally:
        small.close()
        big.close()
    # every recorded gap was published once, retained, before serving
    assert len([t for t, _ in published_few if "/discontinuity/" in t]) == 10
    assert len([t for t, _ in published_many if "/discontinuity/" in t]) == 2000
    assert many <= few * 1.1 + 200, (few, many)


def test_a_gap_is_published_once_its_statement_is_signed_and_only_once(tmp_path):
    """A gap this sequencer records waits for its signed statement, then goes out once."""
    home = tmp_path / "seq"
    service.init(home)
    s = service.Sequencer(home)
    try:
        s.register(G, 0)
        srv, answers = server(s)
        srv._publish_discontinuities()
        s.store.commit_discontinuity(s.store.group(G).__class__(G, 1), 0, None, None, "signing_failed")
        srv._publish_discontinuities()       # not signed yet: not published
        assert not [t for t, _ in srv.client.published if "/discontinuity/" in t]
        s.sign_statements()
        srv._publish_discontinuities()
        srv._publish_discontinuities()
        gaps = [(t, p) for t, p in srv.client.published if "/discontinuity/" in t]
        assert [t for t, _ in gaps] == [f"sovm-seq/{G.hex()}/discontinuity/0"]
        assert s.store.statement(G, 0) is not None and s.store.statement(G, 0) in gaps[0][1]
    finally:
        s.close()


def test_a_flood_of_submits_waits_in_the_inbox_not_in_the_group_commit(tmp_path):
    """Each turn of `sequencer run`'s loop moved up to 512 requests from the (bounded) inbox into
    the group commit, which decides at most CHUNK groups a step: under a flood of Commits for new
    groups its queue grew by about 256 a turn, without bound (each entry holds its Commit, up to
    1 MiB). Now the loop takes from the inbox only while the group commit's backlog holds less than
    serve.BACKLOG_BYTES, so a flood waits in the inbox, where paho's thread waits for room."""
    from agent.sequencer import serve
    home = tmp_path / "seq"
    service.init(home)
    s = service.Sequencer(home)
    try:
        srv, answers = server(s)
        srv._reply = lambda msg, body, then=None: None
        srv.inbound.budget = 1 << 30     # this test fills the inbox itself, as a flood would
        commit = encode_private_message(bytes(16), 0, ciphertext=b"\x00" * 4000)
        size = len(commit)
        n = 6 * serve.BACKLOG_BYTES // size
        for i in range(n):   # Commits for n new groups (each bootstraps its group)
            srv.inbound.put(msg(f"sovm-seq/{i:032x}/submit", encode_private_message(i.to_bytes(16, "big"), 0,
                                                                                  ciphertext=b"\x00" * 4000), mid=i))
        peak = 0
        for _ in range(40):
            srv.turn()
            peak = max(peak, srv.gc.queued_bytes)
            assert srv.gc.queued_bytes == sum(len(m) for _t, _f, m, _c in srv.gc.queue)
        assert peak <= serve.BACKLOG_BYTES + serve.MAX_BATCH * size, (peak, serve.BACKLOG_BYTES)
        while srv.gc.busy() or not srv.inbound.empty():
            srv.turn()
        assert srv.gc.queued_bytes == 0
        assert len(s.store.group_ids()) == n
    finally:
        s.close()


def test_deliveries_stuck_rows_are_bounded_and_the_other_events_kept(tmp_path):
    """Each reconnect of the delivery watch recorded a `deliveries_stuck` row, never trimmed: a
    client that keeps the broker's in-flight slots full (oversized publishes) adds one row every
    40 s for as long as it goes on. Now the newest serve.STUCK_EVENTS_KEPT are kept; every other
    kind of event (rollbacks, discontinuities: the audit trail) is untouched."""
    import types
    from agent.sequencer import serve
    home = tmp_path / "seq"
    service.init(home)
    s = service.Sequencer(home)
    try:
        s.store.record_event("rollback", {"group": G.hex(), "epoch": 3})
        srv, _answers = server(s)
        srv.client.is_connected = lambda: True
        srv.prober = types.SimpleNamespace(step=lambda now: serve.inbox.RECONNECT,
                                           watch=types.SimpleNamespace(wait_s=10, reconnects=0))
        kept = getattr(serve, "STUCK_EVENTS_KEPT", 100)
        for i in range(kept * 3):
            srv.prober.watch.reconnects = i + 1
            srv._watch_deliveries()
        kinds = [e["kind"] for e in s.store.events()]
        assert kinds.count("deliveries_stuck") == kept, len(kinds)
        assert kinds[0] == "rollback"
        newest = [e for e in s.store.events() if e["kind"] == "deliveries_stuck"][-1]
        assert newest["reconnect"] == kept * 3
    finally:
        s.close()
