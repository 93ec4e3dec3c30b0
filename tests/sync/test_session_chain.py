"""The chain rule in the session (one session, every link): after an exchange
this end started moved events, the next one starts at once, until one moves nothing (what ends a
`sync --once` over a serial line). It lived in agent/transport/serial.py; `Session.chain` is the
one decision the serial port and the in-memory link both run."""
from __future__ import annotations

from agent.sync import SyncDriver
from agent.transport.memory import MemoryLink, Pair

from .helpers import NOW, T, log_set, mesh


def write_n(node, n):
    for i in range(n):
        node.write(T, {"device": "c", "seq": i}, {"temp": float(i), "note": ""}, now=NOW + i)


def chained_pair(da, db_, chain):
    a = da.session("memory", db_.node.site_id, secure=True, cycle_ms=600_000)
    b = db_.session("memory", da.node.site_id, secure=True, cycle_ms=600_000)
    p = Pair(a, b, MemoryLink(), chain=chain)
    p.start(NOW)
    t = p.run(NOW, NOW + 10_000)
    assert a.state == b.state == "ready"
    for s in p.sessions:
        s.chain(t)  # the exchanges at the handshake are done: what follows starts from here
        s.events.clear()
    return p, t


def test_an_exchange_that_moved_events_starts_the_next_until_one_moves_nothing(tmp_path):
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a, 100), SyncDriver(b, 100)
    p, t = chained_pair(da, db_, chain=True)
    write_n(b, 250)  # the peer's backlog: one answer carries at most 100 of them
    sa, sb = p.sessions
    t = p.exchange(t + 1, t + 60_000)
    assert log_set(a) == log_set(b), "the chain went on while exchanges moved events"
    started = [e for e in sa.events if e.kind == "exchanged"]
    # one cycle moved events, so the next started at once; the last one moved nothing
    assert len(started) >= 2, started
    assert p.quiet() and not sa.chain(t + 1) and not sb.chain(t + 1), "an exchange that moved nothing ends the chain"
    received = da.stats["received_events"] + db_.stats["received_events"]
    sa.cycle(t + 1)
    p.flush(t + 1)
    p.run(t + 1, t + 60_000)
    assert da.stats["received_events"] + db_.stats["received_events"] == received
    assert [e.kind for e in sa.events].count("exchanged") == len(started) + 1, "one exchange, nothing moved, no chain"


def test_the_session_decides_and_the_driver_only_asks(tmp_path):
    """A driver that does not ask (`chain=False`) leaves the decision standing: the session
    wants the next exchange after one that moved events, and not after one that moved nothing."""
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a, 100), SyncDriver(b, 100)
    p, t = chained_pair(da, db_, chain=False)
    write_n(b, 250)
    t = p.exchange(t + 1, t + 60_000)
    sa, sb = p.sessions
    assert not sb.chain(t + 1), "the answering end never chains"
    assert sa.chain(t + 1), "the last exchange a started moved events: the next one goes at once"
    p.flush(t + 1)
    t = p.run(t + 1, t + 60_000)
    assert log_set(a) == log_set(b)
    assert not sa.chain(t + 1), "an exchange that moved nothing ends the chain"
