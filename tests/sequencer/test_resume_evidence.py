"""§22.5 cl. 2, §22.6 "a restore from backup": a sequencer whose whole machine (home and receipt
witness) was restored cannot tell from anything local that it is behind. `sequencer run` checks
members' evidence before it serves a group after it starts (docs/sequencer.md "Evidence from
members on resume"): the receipt head the broker retains on `PREFIX/GROUP/accepted`, and a Commit
framed above the group's epoch after a resume the witness cannot vouch for. A real mosquitto, the
real `sequencer run`, real homes copied back."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid

import cbor2
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.sequencer import receipts
from agent.sequencer.framing import encode_private_message
from agent.sequencer.member import ReceiptChain
from tests.cli_cmd import agent_cmd, agent_env
from tests.sequencer.test_run_broker import Member, cli

G1 = bytes.fromhex("b1" * 16)
G2 = bytes.fromhex("b2" * 16)
G3 = bytes.fromhex("b3" * 16)
WAIT = 120          # a ceiling that only catches a hang


class Run:
    """`sequencer run` on ``home`` against ``broker``, stopped by SIGTERM."""

    def __init__(self, home, broker, *extra: str) -> None:
        self.proc = subprocess.Popen([*agent_cmd(), "--home", str(home), "sequencer", "run", "--broker", broker.url,
                                      *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=agent_env())
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        self.ready = json.loads(line)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=WAIT)
        assert self.proc.returncode == 0, err


class Released:
    """Everything a sequencer released, as members see it: answers and retained `accepted`
    records; one receipt per (group_id, epoch) is the §22.5 invariant."""

    def __init__(self, key: bytes) -> None:
        self.key, self.seen = key, {}

    def add(self, raw: bytes) -> None:
        r = receipts.verify_receipt(raw, self.key)
        self.seen.setdefault((r.group_id, r.epoch), set()).add(raw)

    def answer(self, ans: dict) -> dict:
        if ans.get("accepted"):
            self.add(bytes.fromhex(ans["receipt"]))
        return ans

    def doubles(self) -> list:
        return [k for k, v in self.seen.items() if len(v) > 1]


def submit(m: Member, gid: bytes, epoch: int, tag: bytes) -> dict:
    return m.request(f"sovm-seq/{gid.hex()}/submit", encode_private_message(gid, epoch, ciphertext=tag * 8), WAIT)


def drain(m: Member, released: Released) -> None:
    while not m.published.empty():
        topic, body, _retain = m.published.get_nowait()
        if topic.endswith("/accepted") and body:
            try:
                released.add(cbor2.loads(body)["receipt"])
            except Exception:
                pass            # a forged record (test b): not the sequencer's


def status(home) -> dict:
    p = cli(home, "status")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def held(home) -> dict:
    return {h["group"]: h for h in status(home).get("held", [])}


def publish_retained(port: int, topic: str, payload: bytes) -> None:
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"rogue-{uuid.uuid4().hex[:8]}", protocol=paho.MQTTv5)
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.publish(topic, payload, qos=1, retain=True).wait_for_publish(WAIT)
    c.loop_stop()
    c.disconnect()


def restore(src, dst) -> None:
    shutil.rmtree(dst)
    shutil.copytree(src, dst)


def test_a_restored_machine_does_not_serve_a_group_whose_head_moved_on(tmp_path, broker):
    """Home and witness copied at epoch 2, the sequencer runs on (G1 to epoch 4), both are
    copied back, `sequencer run` starts again on the same broker: G1, whose head the broker
    retains at epoch 3, is not served (`state_behind`, in `sequencer status`) and no second
    receipt is signed for any (group, epoch); G2 is served. `sequencer recover` with a member's
    receipts brings G1 back at the head the members hold."""
    home, wdir = tmp_path / "seq", os.environ["SSP_AGENT_WITNESS_DIR"]
    key = bytes.fromhex(json.loads(cli(home, "init").stdout)["sequencer_key"])
    released, alice = Released(key), Member(broker.port, "alice")
    try:
        run = Run(home, broker)
        for gid in (G1, G2):
            assert alice.request(f"sovm-seq/{gid.hex()}/register", b"0", WAIT) == {"group": gid.hex(), "epoch": 0}
            for e in range(2):
                assert released.answer(submit(alice, gid, e, b"%d" % e))["accepted"] is True
        run.stop()
        shutil.copytree(home, tmp_path / "snap-home")
        shutil.copytree(wdir, tmp_path / "snap-witness")
        run = Run(home, broker)
        for e in (2, 3):
            assert released.answer(submit(alice, G1, e, b"%d" % e))["accepted"] is True
        run.stop()
        restore(tmp_path / "snap-home", home)                 # the whole machine: home and witness
        restore(tmp_path / "snap-witness", wdir)
        run = Run(home, broker)
        again = released.answer(submit(alice, G1, 2, b"another"))
        assert again["accepted"] is False and again["reason"] == "state_behind", again
        ahead = released.answer(submit(alice, G1, 4, b"four"))
        assert ahead["accepted"] is False and ahead["reason"] == "state_behind", ahead
        assert released.answer(submit(alice, G2, 2, b"g2"))["accepted"] is True
        run.stop()
        drain(alice, released)
        assert released.doubles() == []
        h = held(home)
        assert set(h) == {G1.hex()} and h[G1.hex()]["reason"] == "state_behind", h
        assert h[G1.hex()]["evidence"] == "broker_head" and h[G1.hex()]["epoch"] == 3, h
        # the operator recovers the group from members' evidence (§22.6), then serves it again
        ev = tmp_path / "alice.json"
        ev.write_text(json.dumps({"member": "alice", "attested_epoch": 4,
                                  "receipts": [r.hex() for (g, _e), v in sorted(released.seen.items())
                                               if g == G1 for r in v]}))
        p = cli(home, "recover", "--group", G1.hex(), "--binding", f"0:{key.hex()}", str(ev))
        assert p.returncode == 0, (p.stdout, p.stderr)
        assert json.loads(p.stdout)["outcome"] == "resume", p.stdout
        assert held(home) == {}
        run = Run(home, broker)
        assert released.answer(submit(alice, G1, 3, b"stale"))["reason"] == "stale_epoch"
        won = released.answer(submit(alice, G1, 4, b"four"))
        assert won["accepted"] is True, won
        r4 = receipts.parse_receipt(bytes.fromhex(won["receipt"]))
        r3 = next(iter(released.seen[(G1, 3)]))
        assert r4.previous_receipt_hash == receipts.receipt_hash(r3)
        run.stop()
        drain(alice, released)
        assert released.doubles() == []
    finally:
        alice.close()


def test_a_forged_retained_head_does_not_freeze_a_group(tmp_path, broker):
    """A client allowed on the `accepted` topic retains garbage, and a well-formed record whose
    receipt another key signed at a far epoch: neither is the sequencer's, the group is served
    and the records are surfaced as unsigned evidence (`accepted_unsigned`), not as a gap."""
    home = tmp_path / "seq"
    key = bytes.fromhex(json.loads(cli(home, "init").stdout)["sequencer_key"])
    other = tmp_path / "other"
    cli(other, "init")
    # a real receipt for G1 at epoch 9, signed by another sequencer's key
    f = tmp_path / "m9"
    f.write_bytes(encode_private_message(G1, 9, ciphertext=b"x" * 8))
    p = subprocess.run([*agent_cmd(), "--home", str(other), "sequencer", "submit", str(f)],
                       capture_output=True, text=True, env=agent_env())
    foreign = bytes.fromhex(json.loads(p.stdout)["receipt"])
    released, alice = Released(key), Member(broker.port, "alice")
    try:
        run = Run(home, broker)
        assert released.answer(submit(alice, G1, 0, b"0"))["accepted"] is True
        assert released.answer(submit(alice, G2, 0, b"0"))["accepted"] is True
        run.stop()
        publish_retained(broker.port, f"sovm-seq/{G1.hex()}/accepted",
                         cbor2.dumps({"epoch": 9, "commit": f.read_bytes(), "receipt": foreign}))
        publish_retained(broker.port, f"sovm-seq/{G2.hex()}/accepted", b"\xff\x00 not cbor")
        publish_retained(broker.port, f"sovm-seq/{G3.hex()}/accepted",
                         cbor2.dumps({"epoch": 7, "commit": b"c", "receipt": b"\x84not a receipt"}))
        run = Run(home, broker)
        assert released.answer(submit(alice, G1, 1, b"1"))["accepted"] is True
        assert released.answer(submit(alice, G2, 1, b"1"))["accepted"] is True
        assert released.answer(submit(alice, G3, 0, b"0"))["accepted"] is True      # a new group: bootstrapped
        run.stop()
        assert held(home) == {}
        unsigned = [e for e in status(home)["events"] if e["kind"] == "accepted_unsigned"]
        assert {e["group"] for e in unsigned} == {G1.hex(), G2.hex(), G3.hex()}, unsigned
        assert released.doubles() == []
    finally:
        alice.close()


def test_a_commit_framed_ahead_after_a_resume_that_cannot_prove_its_state(tmp_path, broker):
    """The home is restored onto a machine without its witness (a new witness directory) and the
    broker no longer retains the head: nothing local or retained says the state is behind. A
    member's Commit framed above the group's epoch is that evidence: the group is held
    (`state_behind`, evidence `commit_ahead`) and a stale member's Commit at the restored epoch
    is not signed a second time. A sequencer whose witness vouches for its state answers a Commit
    ahead `future_epoch`, as before, and goes on serving."""
    home = tmp_path / "seq"
    key = bytes.fromhex(json.loads(cli(home, "init").stdout)["sequencer_key"])
    released, alice = Released(key), Member(broker.port, "alice")
    try:
        run = Run(home, broker)
        for gid in (G1, G2):
            for e in range(2):
                assert released.answer(submit(alice, gid, e, b"%d" % e))["accepted"] is True
        run.stop()
        # a normal restart: the witness vouches for the state; a Commit ahead is `future_epoch`
        run = Run(home, broker)
        ahead = released.answer(submit(alice, G2, 5, b"five"))
        assert ahead["accepted"] is False and ahead["reason"] == "future_epoch", ahead
        assert released.answer(submit(alice, G2, 2, b"2"))["accepted"] is True
        run.stop()
        shutil.copytree(home, tmp_path / "snap-home")
        run = Run(home, broker)
        for e in (2, 3):
            assert released.answer(submit(alice, G1, e, b"%d" % e))["accepted"] is True
        run.stop()
        restore(tmp_path / "snap-home", home)
        os.environ["SSP_AGENT_WITNESS_DIR"] = str(tmp_path / "new-machine-witness")
        publish_retained(broker.port, f"sovm-seq/{G1.hex()}/accepted", b"")     # the broker lost it
        run = Run(home, broker)
        ahead = released.answer(submit(alice, G1, 4, b"four"))
        assert ahead["accepted"] is False and ahead["reason"] == "state_behind", ahead
        stale = released.answer(submit(alice, G1, 2, b"another"))
        assert stale["accepted"] is False and stale["reason"] == "state_behind", stale
        assert released.answer(submit(alice, G2, 3, b"3"))["accepted"] is True
        run.stop()
        drain(alice, released)
        assert released.doubles() == []
        h = held(home)
        assert set(h) == {G1.hex()} and h[G1.hex()]["evidence"] == "commit_ahead" and h[G1.hex()]["epoch"] == 4, h
        # the chain members hold still validates: nothing signed twice
        chain = ReceiptChain(G1, key)
        for e in range(4):
            assert chain.add(next(iter(released.seen[(G1, e)]))) is not None
    finally:
        alice.close()


def test_heads_the_broker_will_not_give_stop_only_a_resume_the_witness_cannot_vouch_for(tmp_path):
    """An ACL that lets `sequencer run` serve but refuses its probe topic (where the marker that
    ends the read of the retained heads goes): the heads cannot be read. A resume the witness
    vouches for serves on (event `heads_unread`); a home holding receipts whose witness is gone
    exits 1, signing nothing: it cannot establish what was released (§22.5 cl. 2)."""
    from agent.transport.broker import Broker, free_port, write_password_file
    write_password_file(tmp_path / "passwd", {"seq": "s", "alice": "a"})
    acl = ["user seq"] + [f"topic readwrite sovm-seq/+/{k}" for k in
                          ("submit", "register", "receipt", "evidence", "accepted", "lost", "discontinuity/+")]
    (tmp_path / "acl").write_text("\n".join(acl + ["topic write sovm-member/+/answers", "user alice",
                                                   "topic readwrite #"]) + "\n")
    port = free_port()
    br = Broker(port=port, workdir=tmp_path / "broker", listener_conf=(
        f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {tmp_path / 'passwd'}\n"
        f"acl_file {tmp_path / 'acl'}")).start()

    class At:
        url = f"mqtt://seq:s@127.0.0.1:{port}"

    home = tmp_path / "seq"
    key = bytes.fromhex(json.loads(cli(home, "init").stdout)["sequencer_key"])
    released, alice = Released(key), Member(port, "alice", credentials=("alice", "a"))
    try:
        run = Run(home, At)
        assert released.answer(submit(alice, G1, 0, b"0"))["accepted"] is True
        run.stop()
        assert [e for e in status(home)["events"] if e["kind"] == "heads_unread"] != []
        run = Run(home, At)                 # the witness vouches for G1 at 0: served
        assert released.answer(submit(alice, G1, 1, b"1"))["accepted"] is True
        run.stop()
        os.environ["SSP_AGENT_WITNESS_DIR"] = str(tmp_path / "new-machine-witness")
        p = subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", "run", "--broker", At.url],
                           capture_output=True, text=True, env=agent_env(), timeout=WAIT)
        assert p.returncode == 1 and "cannot establish what was released" in p.stderr, (p.stdout, p.stderr)
        assert p.stdout == ""
        drain(alice, released)
        assert released.doubles() == []
    finally:
        alice.close()
        br.close()


def test_a_receipt_taken_back_from_the_journal_goes_into_the_witness(tmp_path):
    """A crash after the receipt is durable in the signing journal and before the witness holds
    it: the next open takes it back from the journal (§22.5 cl. 1) and notes it in the witness,
    so the witness vouches for the group (a Commit framed ahead is then `future_epoch`, not a
    hold) and a later whole-home restore still jumps past it."""
    import pytest

    from agent.sequencer import service

    class Boom(Exception):
        pass

    def at_persist(point: str) -> None:
        if point == "after_persist":
            raise Boom(point)

    home = tmp_path / "seq"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(G1, 0)
        assert isinstance(s.submit(encode_private_message(G1, 0, ciphertext=b"0" * 8)), service.Accepted)
    s = service.Sequencer(home, fault_hook=at_persist)
    try:
        with pytest.raises(Boom):
            s.submit(encode_private_message(G1, 1, ciphertext=b"1" * 8))
        assert s.witness.top[G1][0] == 0            # the crash point: the journal holds r1, the witness not
    finally:
        s.close()
    with service.Sequencer(home) as s:
        assert s.store.group(G1).current_epoch == 2
        assert s.witness.top[G1] == (1, s.store.receipt(G1, 1))
        assert s.unproven == set()
        ahead = s.submit(encode_private_message(G1, 5, ciphertext=b"5" * 8))
        assert isinstance(ahead, service.Rejected) and ahead.reason == "future_epoch", ahead
        assert s.held == set()
