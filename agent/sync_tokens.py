"""What a sent body needs to be confirmed when its answer comes (§14.1): the selection it was
built from (`Token`: live range, re-offers, backfill rows, control records) and its durable form
in `sync_state.sent_bodies` (`token_to_json`), so an answer taken by a later process still moves
the cursor. `Offer` is one body selected for the MQTT runner. Pure data; the sync driver
(agent/sync.py) makes and confirms them."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BfPart:
    """One backfill job's share of a body: whole rows, in row_key order, after `expect_from`."""
    table: str
    expect_from: bytes | None
    row_keys: tuple[bytes, ...]
    counts: tuple[int, ...]  # events sent for each row (0: nothing left to send for it)
    done: bool  # the walk reached the table's end


@dataclass(frozen=True)
class Token:
    path: str
    start: int
    seqs: tuple[int, ...]
    end: int
    bf_parts: tuple[BfPart, ...] = ()
    rehydrate_gen: int | None = None  # a rehydration reset since selection voids the live advance
    records: tuple[bytes, ...] = ()  # hashes of the control records the body carries (delivered on an answer)
    record_raws: tuple[bytes, ...] = ()  # those records, in body order
    sent_key: bytes | None = None  # the body's row in sync_state.sent_bodies (the key its answer names)
    reoffer_seqs: tuple[int, ...] = ()  # re-offered events (after the live ones, before backfill)
    rescans: tuple[tuple[bytes, int], ...] = ()  # rescan markers the re-offers advance (sync_state)


@dataclass
class Offer:
    """A body selected for a peer (`PortAdapter.select`), kept by the runner until answered."""
    start: int  # the cursor value the selection started from (seq > start)
    end: int  # last seq examined
    seqs: list[int] = field(default_factory=list)
    events: list[bytes] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # tables whose own events policy withheld in (start, end]
    n_backfill: int = 0  # the last n_backfill of `events` are backfill rows' events (not in `seqs`)
    backfill: bool = False  # carries backfill job progress (rows, or the end of a job's walk)
    token: Any = None  # handed back to `advance` with the peer's answer
    body_hash: bytes | None = None  # BLAKE3 of the body as published (set by Runner._send; §5 acknowledgements)


@dataclass
class Backfill:
    events: list[bytes]
    parts: list[BfPart]


def _hex(b: bytes | None) -> str | None:
    return None if b is None else b.hex()


def _unhex(h: str | None) -> bytes | None:
    return None if h is None else bytes.fromhex(h)


def token_to_json(tok: Token, **extra: Any) -> str:
    """A confirmation token as kept in `sent_bodies` (the record raws are not: the body is sent)."""
    return json.dumps({"p": tok.path, "s": tok.start, "q": list(tok.seqs), "e": tok.end, "g": tok.rehydrate_gen,
                       "r": [h.hex() for h in tok.records], "k": _hex(tok.sent_key),
                       "b": [[b.table, _hex(b.expect_from), [k.hex() for k in b.row_keys], list(b.counts), b.done]
                             for b in tok.bf_parts], "o": list(tok.reoffer_seqs),
                       "z": [[site.hex(), upto] for site, upto in tok.rescans], **extra}, separators=(",", ":"))


def token_from_json(text: str) -> tuple[Token, dict]:
    """The token and the extra members stored with it."""
    d = json.loads(text)
    parts = tuple(BfPart(t, _unhex(x), tuple(bytes.fromhex(k) for k in rks), tuple(cs), bool(done))
                  for t, x, rks, cs, done in d.pop("b"))
    tok = Token(d.pop("p"), d.pop("s"), tuple(d.pop("q")), d.pop("e"), parts, d.pop("g"),
                 tuple(bytes.fromhex(h) for h in d.pop("r")), (), _unhex(d.pop("k", None)),
                 reoffer_seqs=tuple(d.pop("o", ())), rescans=tuple((bytes.fromhex(x), u) for x, u in d.pop("z", ())))
    return tok, d
