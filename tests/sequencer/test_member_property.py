"""A property of the member validator (agent/sequencer/member.py; SOVM §22.5-§22.6): over random
honest histories, forks, recorded and unrecorded gaps, signed statements and unsigned claims, held
in random subsets and arrival orders, equivocation is reported iff two valid receipts for one
(group, epoch) differ (or a receipt and a signed gap statement, or two statements, stand at one
epoch) or a link diverges across recorded gaps only; the verdict does not depend on order, an
unsigned claim never changes it, and an honest history is never flagged."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from agent.sequencer import member, receipts
from tests.sequencer.test_member import RogueSequencer

G = bytes.fromhex("a7" * 16)
RS = RogueSequencer()
RECEIPT, GAP, UNRECORDED = "receipt", "gap", "unrecorded"
_signed: dict = {}


def _sign(kind: str, epoch: int, commit: bytes, prev):
    # signatures are the slow part: one history's items are reused across examples
    key = (kind, epoch, commit, prev)
    if key not in _signed:
        _signed[key] = RS.sign(epoch, commit, prev, G) if kind == RECEIPT else RS.statement(epoch, prev, G)
    return _signed[key]


def branch(kinds: list[str], start: int, prev, tag: bytes) -> list[bytes]:
    """A sequencer's items from ``start`` on: a receipt chained to the last one, a signed gap
    statement naming the last one (§22.6 step 4-5), or an epoch skipped with nothing recorded."""
    out = []
    for i, kind in enumerate(kinds):
        e = start + i
        if kind == UNRECORDED:
            continue
        raw = _sign(kind, e, tag + b"%d" % e, prev)
        out.append(raw)
        if kind == RECEIPT:
            prev = receipts.receipt_hash(raw)
    return out


def last_hash(items: list[bytes], below: int):
    rx = [receipts.parse_receipt(r) for r in items if not _is_statement(r)]
    rx = [r for r in rx if r.epoch < below]
    return max(rx, key=lambda r: r.epoch).receipt_hash if rx else None


def _is_statement(raw: bytes) -> bool:
    try:
        receipts.parse_statement(raw)
        return True
    except receipts.ReceiptError:
        return False


def oracle(held: list[bytes]) -> bool:
    """The rule, over the set held, written from §22.5-§22.6 without the validator's bookkeeping."""
    rx: dict[int, set] = {}
    stated: dict[int, set] = {}
    for raw in set(held):
        if _is_statement(raw):
            s = receipts.parse_statement(raw)
            stated.setdefault(s.epoch, set()).add((s.payload_key, s.previous_receipt_hash))
        else:
            r = receipts.parse_receipt(raw)
            rx.setdefault(r.epoch, set()).add((r.raw, r.receipt_hash, r.previous_receipt_hash))
    if any(len(v) > 1 for v in rx.values()) or any(len({k for k, _p in v}) > 1 for v in stated.values()):
        return True                                      # two receipts or two statements for one epoch
    if set(rx) & set(stated):
        return True                                      # a signed gap contradicted by a receipt
    gaps = set(stated)

    def below(e):
        d = e - 1
        while d in gaps:
            d -= 1
        return {h for _raw, h, _p in rx.get(d, ())} if d >= 0 else set()
    for e, v in rx.items():
        names = below(e)
        if names and any(p not in names for _raw, _h, p in v):
            return True
    for e, v in stated.items():
        names = below(e)
        if names and any(p is not None and p not in names for _k, p in v):
            return True
    return False


kinds = st.sampled_from([RECEIPT, RECEIPT, RECEIPT, GAP, UNRECORDED])


@st.composite
def worlds(draw):
    n = draw(st.integers(3, 7))
    honest = branch(draw(st.lists(kinds, min_size=n, max_size=n)), 0, None, b"h")
    items, forked = list(honest), False
    if draw(st.booleans()):
        f = draw(st.integers(1, n - 1))
        tail = draw(st.lists(kinds, min_size=1, max_size=n - f + 1))
        items += branch(tail, f, last_hash(honest, f), b"b")      # a copied home run on from f
        forked = True
    if items and draw(st.booleans()):
        # most of what was released, a few items never seen (a receipt, a statement): where a fork
        # hides behind a missing predecessor
        dropped = draw(st.lists(st.sampled_from(items), unique=True, max_size=3))
        held = [x for x in items if x not in dropped]
    else:
        held = draw(st.lists(st.sampled_from(items), unique=True, max_size=len(items))) if items else []
    claims = draw(st.lists(st.integers(0, n), max_size=3))
    return held, claims, forked


def verdict(held: list[bytes], claims: list[int], order: list[int]) -> member.ReceiptChain:
    c = member.ReceiptChain(G, RS.kid)
    for i in order:
        if i < len(held):
            raw = held[i]
            c.add_statement(raw) if _is_statement(raw) else c.add(raw)
        else:
            c.claim_discontinuity(claims[i - len(held)])
    return c


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.data())
def test_equivocation_iff_the_rule_whatever_the_order(world, data):
    held, claims, forked = world
    idx = list(range(len(held) + len(claims)))
    orders = [idx, idx[::-1], data.draw(st.permutations(idx)), data.draw(st.permutations(idx))]
    want = oracle(held)
    if not forked:
        assert not want                                  # an honest history is never equivocation
    for order in orders:
        c = verdict(held, claims, order)
        assert c.equivocation == want, (order, [(e.kind, e.epoch) for e in c.evidence])
        assert set(c.unsigned) == set(claims) and not (set(c.discontinuities) - set(c.statements))
        # a receipt the member holds is never dropped for a claim: the chain's epochs and the
        # accepted gaps never meet
        assert not (set(c.receipts) & c.discontinuities)
