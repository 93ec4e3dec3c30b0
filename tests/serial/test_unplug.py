"""Serial garbage and unplugs (the outside hostile run's serial scenario): two `ssp-agent run
--serial` processes on real pseudo-terminals through the relay (tools/serial_relay.py), at a
throttled line rate so a sync takes many frames. While bodies are crossing, one end's USB adapter
is pulled (its pty closes, its name goes; the holder reads end of file) and plugged back under the
same name, then the other's; random bytes, long runs without a delimiter and well-framed frames of
nonsense (CRC-clean garbage) are put on the line between frames, in both directions, and both
owners keep writing through the CLI.

What must hold, counted, never timed: the unplug cut a transfer short (the receiver held less than
everything), both agents stay up and reopen their ports, every acknowledged write reaches both
ends (waited for as an event), their dumps are equal, nothing corrupted reached the apply path, and
both stop with exit 0 having counted the noise as rejected frames."""
from __future__ import annotations

import dataclasses
import json
import random
import signal
import subprocess

from agent.node import Node
from agent.profile import load_profile
from firmware_bridge import framing
from serial_relay import LineFaults, Relay
from tests.waiting import wait_until

from ..cli_cmd import agent_cmd, agent_env, run_cli
from ..mqtt.helpers import MANIFEST, T, wait_serving

PROFILE = dataclasses.replace(load_profile("pi-3-4"), serial_keepalive_s=0.3, serial_dead_s=1.5,
                              serial_timeout_s=20.0, cadence_s=1.0, serial_batch_limit=10)
N_A, N_B = 80, 30
BAUD = 38_400


def homes(tmp):
    nodes = [Node.init(tmp / n, MANIFEST, profile=PROFILE)[0] for n in ("a", "b")]
    a, b = nodes
    a.add_peer(b.site_id, b.keyring[b.site_id][0], None)
    b.add_peer(a.site_id, a.keyring[a.site_id][0], None)
    a.write_many([(T, {"device": "a", "seq": i}, {"temp": float(i), "note": "from a " * 8}, False) for i in range(N_A)])
    b.write_many([(T, {"device": "b", "seq": i}, {"temp": float(i), "note": "from b " * 8}, False) for i in range(N_B)])
    for x in nodes:
        x.close()
    return tmp / "a", tmp / "b"


def spawn(home, port):
    return subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--serial", port], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=agent_env())


def noise(rng: random.Random) -> bytes:
    kind = rng.randrange(3)
    if kind == 0:      # random bytes, delimiters among them
        return rng.randbytes(rng.randrange(1, 400))
    if kind == 1:      # a long run without a delimiter: the decoder's bound, not the input's length
        return bytes(rng.randrange(1, 256) for _ in range(rng.randrange(500, 3000)))
    # a well-framed frame of nonsense: passes the CRC, must change nothing
    return framing.encode(bytes([rng.choice([0, 1, 2, 3, 4, 9])]) + rng.randbytes(rng.randrange(0, 60)), 1024,
                          lead=True)


def test_garbage_and_unplugs_mid_body_converge(tmp_path):
    ha, hb = homes(tmp_path)
    relay = Relay(LineFaults(seed=21), LineFaults(seed=22), baud=BAUD,
                  names=(str(tmp_path / "ttyUSB-a"), str(tmp_path / "ttyUSB-b"))).start()
    rng = random.Random(77)
    procs = {"a": spawn(ha, relay.ports[0]), "b": spawn(hb, relay.ports[1])}
    acked = {("a", i) for i in range(N_A)} | {("b", i) for i in range(N_B)}

    def alive() -> bool:
        for k, p in procs.items():
            assert p.poll() is None, (k, p.communicate()[1][-3000:])
        return True

    def rows(h) -> set:
        alive()
        p = run_cli("--home", h, "dump")
        assert p.returncode == 0, p.stderr
        return {(r["key"]["device"], r["key"]["seq"]) for r in json.loads(p.stdout).get(T, [])}

    def write(h, device, seq) -> None:
        p = run_cli("--home", h, "write", T, "--key", json.dumps({"device": device, "seq": seq}),
                    "--set", json.dumps({"temp": float(seq)}))
        assert p.returncode == 0, p.stderr
        acked.add((device, seq))

    def shower(n: int) -> None:
        for _ in range(n):
            relay.inject(rng.randrange(2), noise(rng))

    try:
        wait_serving(ha, procs["a"])
        wait_serving(hb, procs["b"])
        # A's backlog is crossing to B: pull B's adapter, then (the rest crossing again) A's
        for k, end in enumerate((1, 0)):
            start = relay.delivered[0]
            wait_until(lambda: alive() and relay.delivered[0] > start + 2500, "A's bytes crossing to B")
            shower(10)
            relay.unplug(end)          # that end's adapter leaves its computer, mid-transfer
            assert rows(hb) != acked, "the unplug came after everything had crossed: nothing was cut short"
            seq = 1000 + 10 * k
            write(ha, "a", seq)        # both owners write while the cable is out
            write(hb, "b", seq)
            shower(10)                 # noise reaches the end still plugged
            relay.replug(end)
            shower(10)
        # the writes after the replugs cross with more noise on the line
        before = relay.injected[:]
        shower(30)
        wait_until(lambda: relay.injected[0] > before[0] and relay.injected[1] > before[1], "noise on both ends")
        wait_until(lambda: rows(ha) == acked and rows(hb) == acked, "every acknowledged write on both ends")
        assert run_cli("--home", ha, "dump").stdout == run_cli("--home", hb, "dump").stdout
        outs = {}
        for k in ("a", "b"):
            procs[k].send_signal(signal.SIGTERM)
            out, err = procs[k].communicate(timeout=300)
            assert procs[k].returncode == 0, (k, err[-3000:])
            outs[k] = json.loads(out)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
        relay.close()
    for k, s in outs.items():
        assert s["rejected"] == 0, (k, s)                 # nothing corrupted reached the apply path
        # (whether an end saw its link end depends on how long the cable was out against its
        # timers, i.e. on the machine's pace: the transfer cut short is asserted above instead)
        assert s["link"]["frames_rejected"] > 0, (k, s)  # the noise arrived and was refused as frames
