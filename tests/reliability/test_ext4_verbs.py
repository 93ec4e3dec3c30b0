"""The verbs tests/reliability/test_ext4_full.py does not run on a nearly full real ext4 home
(docs/reliability.md "Full disk"): the read verbs `log`, `check`, `metrics`, `keystore show`,
`peer list`, `policy list`, and the writing ones `mailbox export`, `evict --auto`, `sync --once` on
a real mosquitto, at a few figures of free space on 1 KiB blocks (where SQLite's WAL index, grown
sparsely and mapped, killed verbs by SIGBUS) and on 4 KiB blocks. Each succeeds or fails with one
line (exit 1; `check` says what it found with its own exit statuses 3 and 4), never dies by a
signal, and the read verbs succeed; tools/full_disk.py runs every figure from 0 to 64 KiB."""
from __future__ import annotations

import json

import pytest

from .ext4img import cli, ext4, leave_free, unavailable, verdict
from .test_ext4_full import T, body, make_home, peer

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

READ = ("log", "metrics", "peer list", "policy list")   # must succeed: `check` reports; `keystore show` opens the keystore
FIGURES = {1024: (0, 8, 64), 4096: (0,)}   # KiB left free


def verbs(home, out, broker_url: str, peer_site: str) -> dict[str, tuple]:
    """verb -> its command line after --home."""
    return {"log": ("log",), "check": ("check", "--json"), "metrics": ("metrics", "--out", "-"),
            "keystore show": ("keystore", "show"), "peer list": ("peer", "list"), "policy list": ("policy", "list"),
            "mailbox export": ("mailbox", "export", "--peer", peer_site, "--out", out),
            "evict --auto": ("evict", "--auto"),
            "sync --once": ("sync", "--broker", broker_url, "--once", "--timeout", "1")}


@pytest.mark.parametrize("block", sorted(FIGURES))
def test_the_other_verbs_never_die_by_a_signal_on_a_nearly_full_disk(tmp_path, broker, block):
    with ext4(tmp_path, "48M", block) as fs:
        home = make_home(fs, tmp_path)
        f = tmp_path / "b.ssp"
        f.write_bytes(body(peer(), range(20), 1000))
        assert cli(home, "mailbox", "import", f).returncode == 0     # something to export and to list
        site = peer().site_id.hex()
        bad, ran = {}, 0
        for kib in FIGURES[block]:
            filler = leave_free(fs, kib * 1024)
            try:
                for verb, args in verbs(home, tmp_path / f"out-{kib}.ssp", broker.url, site).items():
                    p = cli(home, *args)
                    ran += 1
                    if verb == "check":
                        # a health check's statuses: 0 all OK, 3 a warning, 4 a failure (the full disk)
                        what = None if p.returncode in (0, 3, 4) and json.loads(p.stdout)["checks"] else \
                            f"exit {p.returncode}: {p.stderr.strip()[-600:]!r}"
                    else:
                        what = verdict(p)
                    if what is None and verb in READ and p.returncode != 0:
                        what = f"a read verb failed: {p.stderr.strip()[-300:]!r}"
                    if what is not None:
                        bad[(kib, verb)] = what
            finally:
                filler.unlink()
        assert bad == {}, bad
        assert ran == len(FIGURES[block]) * 9
        # space back: the verbs that write work
        assert cli(home, "write", T, "--key", '{"device": "d", "seq": 999}', "--set", '{"temp": 1.5}').returncode == 0
        assert cli(home, "mailbox", "export", "--peer", site, "--out", tmp_path / "last.ssp").returncode == 0


def verdicts(home, verbs: dict, reads: tuple) -> dict:
    """verb -> what went wrong (None: succeeded, or failed with one line); `reads` must succeed."""
    out = {}
    for verb, args in verbs.items():
        p = cli(home, *args)
        what = verdict(p)
        if what is None and verb in reads and p.returncode != 0:
            what = f"a read verb failed: {p.stderr.strip()[-300:]!r}"
        out[verb] = what
    return out


def run_verdict(home, broker_url: str) -> str | None:
    """`run` on a nearly full disk: serves (its control socket answers `status`) and stops on
    SIGTERM with exit 0, or exits 1 with one line; never dies by a signal nor hangs."""
    import signal
    import subprocess
    import time
    from tests.cli_cmd import agent_cmd, agent_env
    proc = subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", broker_url, "--cadence", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    try:
        deadline = time.monotonic() + 600     # a hang, not a speed
        while proc.poll() is None:
            q = cli(home, "status")
            if q.returncode == 0 and "run" in json.loads(q.stdout):
                break
            assert time.monotonic() < deadline, "run neither served nor exited"
            time.sleep(0.3)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        so, se = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return verdict(subprocess.CompletedProcess(proc.args, proc.returncode, so, se))


def test_record_table_rehydrate_and_run_never_die_by_a_signal_on_a_nearly_full_disk(tmp_path, broker):
    """The verbs left: the authority's (`authority add`, `record issue-vouch`, `record import`,
    `record list`), `table create`, `rehydrate --from` / `--status`, and `run` starting with a
    few KiB free. Each succeeds or fails with one line; the read verbs succeed."""
    from agent.simpeer import SimPeer
    auth = json.loads(cli(tmp_path / "unused", "authority", "create", "--out", tmp_path / "auth").stdout)
    with ext4(tmp_path, "48M", 1024) as fs:
        home = make_home(fs, tmp_path)
        issuer = tmp_path / "issuer"             # the operator's home, off the full disk
        assert cli(issuer, "init", "--manifest", tmp_path / "m.toml").returncode == 0
        for h in (issuer, home):
            p = cli(h, "authority", "add", "--site-id", auth["site_id"], "--public-key", auth["public_key"])
            assert p.returncode == 0, p.stderr
        bad, ran = {}, 0
        for kib in (0, 8, 64):
            subject = SimPeer(bytes(16))
            vouch = tmp_path / f"vouch-{kib}.cose"       # made with space, imported without
            assert cli(issuer, "record", "issue-vouch", "--subject", subject.site_id.hex(),
                       "--public-key", subject.key.verify_key.encode().hex(), "--authority-key",
                       tmp_path / "auth", "--out", vouch).returncode == 0
            spec = {"schema": "app", "name": f"t{kib}", "category": "syncable", "key": ["k"], "columns": {"k": "text"}}
            verbs = {"authority add": ("authority", "add", "--site-id", auth["site_id"], "--public-key", auth["public_key"]),
                     "record issue-vouch": ("record", "issue-vouch", "--subject", subject.site_id.hex(), "--public-key",
                                            subject.key.verify_key.encode().hex(), "--authority-key", tmp_path / "auth",
                                            "--out", fs / f"v-{kib}.cose"),
                     "record import": ("record", "import", vouch),
                     "record list": ("record", "list"),
                     "table create": ("table", "create", "--spec", json.dumps(spec)),
                     "rehydrate --from": ("rehydrate", "--from", peer().site_id.hex()),
                     "rehydrate --status": ("rehydrate", "--status")}
            filler = leave_free(fs, kib * 1024)
            try:
                got = verdicts(home, verbs, ("record list", "rehydrate --status"))
                ran += len(got)
                bad |= {(kib, v): w for v, w in got.items() if w is not None}
                what = run_verdict(home, broker.url)
                ran += 1
                if what is not None:
                    bad[(kib, "run")] = what
            finally:
                filler.unlink()
        assert bad == {}, bad
        assert ran == 3 * 8
        # space back: the home works
        assert cli(home, "write", T, "--key", '{"device": "d", "seq": 999}', "--set", '{"temp": 1.5}').returncode == 0
        assert run_verdict(home, broker.url) is None


def test_the_remaining_verbs_never_die_by_a_signal_on_a_nearly_full_disk(tmp_path):
    """Every other verb of a device's home: the keyring's and the policy's writes, `evict` of one
    table, `table add-column`, `keystore rotate-data-key`, `identity rebind`, the member's
    sequencing reads, `watch`, and `init` of a new home on the full filesystem. Each succeeds or
    fails with one line; the read verbs succeed; an `init` that failed leaves no home behind."""
    from agent.simpeer import SimPeer
    with ext4(tmp_path, "48M", 1024) as fs:
        home = make_home(fs, tmp_path)
        bad, ran = {}, 0
        for kib in (0, 8, 64):
            other = SimPeer(bytes(16))
            verbs = {"peer add": ("peer", "add", "--site-id", other.site_id.hex(), "--public-key",
                                  other.key.verify_key.encode().hex()),
                     "peer remove": ("peer", "remove", "--site-id", peer().site_id.hex()),
                     "policy allow": ("policy", "allow", "--peer", "*", "--table", T, "--layer", "user"),
                     "policy deny": ("policy", "deny", "--peer", other.site_id.hex(), "--table", T, "--layer", "role",
                                     "--role", "r"),
                     "policy remove": ("policy", "remove", "--peer", "*", "--table", T, "--layer", "user"),
                     "evict": ("evict", T, "--horizon", "1000.0"),
                     "table add-column": ("table", "add-column", T, "--column", f"c{kib}", "--type", "text"),
                     "keystore rotate-data-key": ("keystore", "rotate-data-key"),
                     "identity rebind": ("identity", "rebind", "--confirm-original-destroyed"),
                     "commits status": ("commits", "status"),
                     "sequencing status": ("sequencing", "status"),
                     "watch": ("watch", "--since", "0", "--idle", "0.5")}
            filler = leave_free(fs, kib * 1024)
            try:
                got = verdicts(home, verbs, ("commits status", "sequencing status", "watch"))
                ran += len(got)
                bad |= {(kib, v): w for v, w in got.items() if w is not None}
                new = fs / f"new-{kib}"
                p = cli(new, "init", "--manifest", tmp_path / "m.toml")
                ran += 1
                what = verdict(p)
                if what is None and p.returncode and new.exists() and any(new.iterdir()):
                    what = f"a failed init left {sorted(x.name for x in new.iterdir())}"
                if what is not None:
                    bad[(kib, "init")] = what
            finally:
                filler.unlink()
        assert bad == {}, bad
        assert ran == 3 * 13
        assert cli(home, "write", T, "--key", '{"device": "d", "seq": 999}', "--set", '{"temp": 1.5}').returncode == 0
        assert cli(home, "check").returncode in (0, 3), cli(home, "check").stdout
