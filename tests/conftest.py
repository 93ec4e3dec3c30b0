
import os

import pytest

# This machine (and CI containers) run no time sync: the kernel reports STA_UNSYNC. The suite
# declares the wall clock trustworthy (docs/apply.md "Clocks without an RTC"); the tests of the
# clock rule (tests/lifecycle/test_clock_trust.py) remove this and drive the sync state themselves.
os.environ.setdefault("SSP_AGENT_CLOCK_TRUSTED", "1")


@pytest.fixture
def broker(tmp_path):
    """A real mosquitto (Debian `mosquitto`), started by the project's own wrapper on a free
    loopback port, for every test that syncs or sequences through a broker."""
    from agent.transport.broker import Broker, find_mosquitto
    if find_mosquitto() is None:
        pytest.fail("mosquitto is not installed (apt-get install mosquitto); this test needs a real broker")
    b = Broker(workdir=tmp_path / "broker").start()
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _witness_dir(tmp_path_factory, monkeypatch):
    # Nodes mirror their clock ceiling outside their home; keep it inside the test's temp dir.
    monkeypatch.setenv("SSP_AGENT_WITNESS_DIR", str(tmp_path_factory.mktemp("witness")))


@pytest.fixture(autouse=True)
def _stop_leaked_apply_workers(monkeypatch):
    # A test that leaves a Node open keeps its apply workers, and with them this process's worker
    # allowance (agent/applyworker.py): every later test in the process would then apply without
    # workers, or fail tests that count them. Workers a test left running are stopped after it.
    from agent.node import Node
    made = []
    orig = Node.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        made.append(self)
    monkeypatch.setattr(Node, "__init__", init)
    yield
    for n in made:
        pool, n._pool = getattr(n, "_pool", None), None
        if pool:
            pool.close()


# The longest files first: pytest-xdist (--dist loadfile, tools/test.sh) hands files to workers in
# collection order, so a long file collected late runs alone at the end while the other worker
# idles. Listed from the suite's --durations, longest first; every other file keeps its order.
LONG_FIRST = (
    "tests/sequencer/test_sequencer_crash.py",
    "tests/mqtt/test_quiet.py",
    "tests/test_bench_smoke.py",
    "tests/reliability/test_powercut.py",
    "tests/sync/test_state_machine.py",
    "tests/bridge/test_bridge_crash.py",
    "tests/reliability/test_powercut_run.py",
    "tests/core/test_convergence_property.py",
    "tests/reliability/test_ext4_verbs.py",
    "tests/fleet/test_rehearsal.py",
    "tests/reliability/test_ext4_full.py",
    "tests/convergence/test_histories.py",
    "tests/sequencer/test_broker_sizes.py",
    "tests/lifecycle/test_replacement_cli.py",
    "tests/lifecycle/test_init_killed.py",
    "tests/sequencer/test_gossip.py",
    "tests/reliability/test_powercut_mixed.py",
    "tests/mqtt/test_oversize.py",
    "tests/install/test_wheelhouse_versions.py",
    "tests/install/test_wheelhouse.py",
    "tests/sequencer/test_run_crash.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {f: i for i, f in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))   # stable
