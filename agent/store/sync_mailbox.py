"""The mailbox's answers (agent/mailbox.py, SQLite): the answers this node owes each peer, the
answer records it signed, and other nodes' answer records it relays."""
from __future__ import annotations

import json
import sqlite3


# ---------------------------------------------------------------- mailbox answers (agent/mailbox.py)
MAILBOX_ANSWERS_KEPT = 16  # answers owed per peer (an ack carries at most 16)
MAILBOX_ACKS_KEPT = 4  # signed answer records kept per peer (the newest is re-used while nothing changed)
MAILBOX_RELAY_PER_ISSUER = 64  # other nodes' answer records relayed: subjects kept per issuer


def owe_mailbox_answer(conn: sqlite3.Connection, peer: bytes, h: bytes, processed: int, now_ms: int) -> None:
    """This node imported file `h` from `peer` and processed its first `processed` events to a
    final state. A file imported again keeps the larger count; the newest files are kept."""
    r = conn.execute("SELECT processed FROM mailbox_owed WHERE peer=? AND body_hash=?", (peer, h)).fetchone()
    conn.execute("INSERT OR REPLACE INTO mailbox_owed VALUES (?,?,?,?)",
                 (peer, h, processed if r is None else max(r[0], processed), now_ms))
    conn.execute("DELETE FROM mailbox_owed WHERE peer=? AND body_hash NOT IN (SELECT body_hash FROM mailbox_owed "
                 "WHERE peer=? ORDER BY received_ms DESC, body_hash LIMIT ?)", (peer, peer, MAILBOX_ANSWERS_KEPT))


def owed_mailbox_answers(conn: sqlite3.Connection, peer: bytes) -> list[tuple[bytes, int]]:
    """(file hash, processed), oldest first."""
    return [(bytes(h), k) for h, k in conn.execute(
        "SELECT body_hash, processed FROM mailbox_owed WHERE peer=? ORDER BY received_ms, body_hash", (peer,))]


def _answers_json(answers: list[tuple[bytes, int]]) -> str:
    return json.dumps([[h.hex(), k] for h, k in answers])


def mailbox_ack_saying(conn: sqlite3.Connection, peer: bytes, answers: list[tuple[bytes, int]]) -> bytes | None:
    """A held answer record to `peer` that says exactly `answers` (re-used: no new signature)."""
    r = conn.execute("SELECT raw FROM mailbox_acks WHERE peer=? AND answers=? ORDER BY issued_ms DESC LIMIT 1",
                     (peer, _answers_json(answers))).fetchone()
    return None if r is None else bytes(r[0])


def put_mailbox_ack(conn: sqlite3.Connection, h: bytes, peer: bytes, answers: list[tuple[bytes, int]], raw: bytes,
                    issued_ms: int, prune: bool = True) -> None:
    """Keep an answer record this node signed. `prune`: drop the oldest beyond MAILBOX_ACKS_KEPT
    (off when recovery stores released ones: each must be held until the journal has dropped it,
    or the next open would store it again, docs/keystore.md)."""
    conn.execute("INSERT OR IGNORE INTO mailbox_acks VALUES (?,?,?,?,?)", (h, peer, _answers_json(answers), issued_ms,
                                                                             raw))
    if prune:
        conn.execute("DELETE FROM mailbox_acks WHERE peer=? AND record_hash NOT IN (SELECT record_hash FROM "
                     "mailbox_acks WHERE peer=? ORDER BY issued_ms DESC, record_hash LIMIT ?)",
                     (peer, peer, MAILBOX_ACKS_KEPT))


def relay_mailbox_ack(conn: sqlite3.Connection, subject: bytes, issuer: bytes, issued_at: int, raw: bytes) -> bool:
    """Keep `issuer`'s answer record to `subject` for the files to `subject`, if it is newer than
    the one held (an answer names the issuer's newest files from the subject)."""
    r = conn.execute("SELECT issued_at FROM mailbox_relay WHERE subject=? AND issuer=?", (subject, issuer)).fetchone()
    if r is not None and r[0] >= issued_at:
        return False
    conn.execute("INSERT OR REPLACE INTO mailbox_relay VALUES (?,?,?,?)", (subject, issuer, issued_at, raw))
    # Bounded per issuer: a signer naming fictional subjects cannot grow the store (or every file).
    conn.execute("DELETE FROM mailbox_relay WHERE issuer=? AND subject NOT IN (SELECT subject FROM mailbox_relay "
                 "WHERE issuer=? ORDER BY issued_at DESC, subject LIMIT ?)", (issuer, issuer, MAILBOX_RELAY_PER_ISSUER))
    return True


def relayed_mailbox_acks(conn: sqlite3.Connection, peer: bytes) -> list[bytes]:
    """The relayed answer records a file to `peer` carries: those addressed to `peer` first, then
    the others (they go on round the ring), never `peer`'s own."""
    return [bytes(r) for (r,) in conn.execute(
        "SELECT raw FROM mailbox_relay WHERE issuer != ? ORDER BY subject != ?, subject, issuer", (peer, peer))]


def mailbox_owed_peers(conn: sqlite3.Connection) -> list[bytes]:
    return [bytes(p) for (p,) in conn.execute("SELECT DISTINCT peer FROM mailbox_owed ORDER BY peer")]
