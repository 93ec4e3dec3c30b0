"""The benchmarks still run end to end with tiny sizes, so they cannot rot between measurements.
Figures are never asserted here: speed is measured by running bench/ itself (docs/performance.md).
A run without `--record` writes no result file (bench/_harness.py record), so these tiny runs
never overwrite a real result in bench/results/."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CASES = [
    (["bench/apply.py", "--events", "600", "--rounds", "1"], "peak RSS, fresh process"),
    (["bench/bench_scale.py", "--quick"], "eviction:"),
    (["bench/bench_sync.py", "--events", "600"], "overhead ratio"),
    (["bench/bench_mqtt.py", "--events", "600"], "raw paho QoS1"),
    (["bench/bench_acks.py", "--events", "40", "--repeat", "1", "--signatures", "10"], "bridge alone"),
    (["bench/bench_keystore.py", "--quick"], "Node.write_many (256) / raw two-core batch sign"),
    (["bench/bench_startup.py", "--quick"], "wall / python -c pass"),
    (["bench/bench_lifecycle.py", "--days", "1", "--rehydrate-events", "600"], "rehydrate_events_per_s"),
    (["bench/bench_serial.py", "--events", "60", "--ber-events", "30", "--ber", "1e-4"], "ratio to line limit"),
    (["bench/bench_sequencer.py", "--quick", "--no-pkcs11"], "group commit"),
    (["bench/bench_idle.py", "--sizes", "0,200", "--seconds", "1", "--warmup", "0.5"], "ratio to the empty store"),
    (["bench/bench_quiet.py", "--minutes", "2", "--scale", "0.01"], "per delivered event"),
    (["bench/bench_syncrate.py", "--events", "300", "--rounds", "1", "--serial-events", "30"],
     "ratio serial sync / line limit"),
    (["bench/bench_fleet.py", "--smoke"], "heal conv s"),
    (["bench/bench_flood.py", "--events", "100", "--rate", "100", "--seconds", "2"], "slowdown ratio flood / no flood"),
    (["bench/bench_atrest.py", "--events", "300", "--rounds", "1"], "at-rest overhead ratio (apply, offer)"),
    (["bench/bench_secure_delete.py", "--events", "300", "--writes", "200", "--rounds", "1"],
     "secure_delete cost ratios to off"),
    (["bench/client.py", "--writes", "100", "--singles", "5", "--latency", "5", "--rounds", "1"],
     "ratio_client_batched_to_node"),
    (["bench/bench_strategies.py", "never_answers", "--rounds", "1", "--events", "40", "--attack-s", "1"],
     "per attacker byte (median)"),
]


@pytest.mark.parametrize("args,marker", CASES, ids=[c[0][0] for c in CASES])
def test_benchmark_runs(tmp_path, args, marker):
    results = tmp_path / "results"
    env = dict(os.environ, SSP_AGENT_WITNESS_DIR=str(tmp_path / "witness"), SSP_BENCH_RESULTS=str(results))
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert marker in p.stdout, p.stdout[-2000:]
    # the bench reached its record step (the one after its printed figures) and, unasked, wrote nothing
    assert not results.exists() and "recorded:" not in p.stdout, p.stdout[-2000:]
