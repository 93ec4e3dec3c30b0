"""`ssp-agent check`, in the spirit of `iotedge check`: one line per check with
OK, WARN or FAIL, what was found and, when not OK, a hint saying what to do. It reads the home
through a read view (it writes nothing, works beside a running `run` and on a full disk) and opens
one short MQTT connection of its own (a different client id, so a running agent keeps its
session). Exit status by the worst line: 0 all OK, 3 a WARN, 4 a FAIL (docs/operations.md)."""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

OK, WARN, FAIL = "OK", "WARN", "FAIL"
EXIT = {OK: 0, WARN: 3, FAIL: 4}
_RANK = {OK: 0, WARN: 1, FAIL: 2}
# Kinds of surfaced rows that mean something went wrong (docs/apply.md, `ssp-agent events`).
FAULT_KINDS = ("rejected", "dropped", "refused", "disk_budget", "record_dropped", "policy_denied")
FAULT_WINDOW_MS = 24 * 3600 * 1000
PEER_LAG_WARN_MS = 3600 * 1000


def line(check: str, status: str, message: str, hint: str | None = None, **detail) -> dict:
    return {"check": check, "status": status, "message": message, "hint": hint if status != OK else None,
            **({"detail": detail} if detail else {})}


def worst(lines: list[dict]) -> str:
    return max((ln["status"] for ln in lines), key=_RANK.__getitem__, default=OK)


def _ago(ms: int) -> str:
    s = abs(ms) / 1000
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.0f} s"


# ---------------------------------------------------------------- the checks
def check_home(home: Path):
    """(line, node or None): the home opens as a node through a read view."""
    from .node import Node, NodeError
    from .store import migrations
    from .store.db import StoreError
    if not home.exists():
        return line("home", FAIL, f"{home} does not exist",
                    f"create the node: ssp-agent --home {home} init --manifest FILE"), None
    try:
        node = Node.open(home, read_only=True)
    except (NodeError, StoreError) as e:
        return line("home", FAIL, str(e), "see the message; `ssp-agent status` shows the same"), None
    except Exception as e:   # a damaged store or journal: say it, keep checking what can be
        return line("home", FAIL, f"{home}: {e}", "keep a copy of the home; docs/operations.md"), None
    v = migrations.store_version(node.conn)
    mode = home.stat().st_mode & 0o777
    if mode & 0o077:
        return line("home", WARN, f"{home} is readable by others (mode {oct(mode)})", f"chmod 700 {home}"), node
    if v < migrations.LATEST:
        return line("home", WARN, f"node {node.site_id.hex()} at {home}; store layout {v} (this agent: "
                    f"{migrations.LATEST})", "the next writing verb (write, sync, run) migrates it"), node
    return line("home", OK, f"node {node.site_id.hex()} at {home}; store layout {v}; profile {node.profile.name}"), node


def check_keystore(node) -> dict:
    from .node import home_paths
    card = node.keystore_card()
    state = card.get("journal_state") or {}
    conf = home_paths(node.home, dict(card.get("keystore") or {}))
    kind = conf.get("kind")
    journal = (f"journal {state.get('records', 0)} record(s), {state.get('bytes', 0)} bytes"
               + (f", torn tail {state['torn_tail_bytes']} bytes (truncated by the next writing open)"
                  if state.get("torn_tail_bytes") else "")) if isinstance(state, dict) else f"journal {state}"
    if kind == "software":
        d = Path(conf.get("dir") or node.home / "keystore")
        keys = list(d.glob("*.key")) if d.is_dir() else []
        if not keys:
            return line("keystore", FAIL, f"software keystore {d} holds no key", "the node cannot sign; restore "
                        "the keystore directory from its backup or initialise a new node")
        loose = [k.name for k in keys if k.stat().st_mode & 0o077]
        if loose:
            return line("keystore", WARN, f"key files readable by others: {', '.join(loose)}", f"chmod 600 {d}/*.key")
        return line("keystore", OK, f"software keystore {d} ({len(keys)} key(s)); {journal}")
    if kind == "pkcs11":
        mod = conf.get("module")
        if not mod or not Path(mod).exists():
            return line("keystore", FAIL, f"PKCS#11 module {mod} not found", "install the token's module (e.g. softhsm2) "
                        "or fix the keystore configuration")
        if conf.get("pin_env") and not os.environ.get(conf["pin_env"]):
            return line("keystore", FAIL, f"PIN variable {conf['pin_env']} is not set",
                        f"set {conf['pin_env']} in the environment of the service")
        if conf.get("pin_file") and not os.access(conf["pin_file"], os.R_OK):
            return line("keystore", FAIL, f"PIN file {conf['pin_file']} is not readable", "check its owner and mode")
        return line("keystore", OK, f"PKCS#11 token {conf.get('token_label')} via {mod}")
    if kind == "serial":
        port = conf.get("port")
        if not port or not Path(port).exists():
            return line("keystore", FAIL, f"serial keystore port {port} not present", "plug the device in; check dmesg")
        return line("keystore", OK, f"serial keystore on {port}")
    return line("keystore", WARN, f"keystore kind {kind!r} not checked", "ssp-agent keystore show")


def probe_broker(settings, client_id: str, timeout: float, topic: str | None = None) -> tuple[str, str]:
    """Connect once (clean session, no subscription), and with `topic` publish one empty message
    there that expires at once. ('ok'|'refused'|'denied'|'unreachable', detail): 'denied' is a
    login the broker accepts but whose publish its ACL refuses."""
    import ssl

    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion
    done, res = threading.Event(), {}
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    if settings.username is not None:
        c.username_pw_set(settings.username, settings.password)
    if settings.tls:
        try:
            c.tls_set(ca_certs=settings.ca_file, certfile=settings.cert_file, keyfile=settings.key_file,
                      cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
        except (OSError, ssl.SSLError, ValueError) as e:
            return "unreachable", f"TLS set-up failed: {e}"

    published = threading.Event()

    def on_connect(client, userdata, flags, reason_code, properties):
        res["rc"] = reason_code
        done.set()

    def on_publish(client, userdata, mid, reason_code, properties):
        res["pub"] = reason_code
        published.set()
    c.on_connect = on_connect
    c.on_publish = on_publish
    try:
        c.connect(settings.host, settings.port, keepalive=10, clean_start=True)
    except (OSError, ssl.SSLError) as e:
        return "unreachable", str(e)
    c.loop_start()
    try:
        if not done.wait(timeout):
            return "unreachable", f"no CONNACK within {timeout:g} s"
        rc = res["rc"]
        if rc.is_failure:
            return "refused", str(rc)
        if topic is None:
            return "ok", "connected"
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        from .transport.mqtt import NOT_AUTHORIZED
        props = Properties(PacketTypes.PUBLISH)
        props.MessageExpiryInterval = 1   # never waits for a sleeping node; a running one takes it as a probe
        c.publish(topic, b"", qos=1, properties=props)
        if not published.wait(timeout):
            return "unreachable", f"no PUBACK within {timeout:g} s"
        pub = res["pub"]
        return ("denied", str(pub)) if getattr(pub, "value", 0) == NOT_AUTHORIZED else ("ok", "connected")
    finally:
        c.disconnect()
        c.loop_stop()


def check_broker(settings, site_id: bytes | None, timeout: float, mesh_id: bytes | None = None) -> dict:
    if settings is None:
        return line("broker", WARN, "no broker configured (no --broker, SSP_MQTT_BROKER or [mqtt] broker in "
                    "/etc/ssp-agent/agent.toml)", "configure one (docs/systemd.md), or ignore on a mailbox-only node")
    where = f"{'mqtts' if settings.tls else 'mqtt'}://{settings.host}:{settings.port}"
    cid = f"{site_id.hex() if site_id else 'ssp'}-check-{uuid.uuid4().hex[:8]}"
    # The node's own inbox under its own name: the one topic the per-device ACLs let it publish to
    # that nobody else reads (a running node's link takes it as its delivery probe).
    from .transport.mqtt import Topics
    topic = Topics(mesh_id, settings.prefix).requests(site_id, site_id) if site_id and mesh_id else None
    outcome, detail = probe_broker(settings, cid, timeout, topic)
    who = f" as {settings.username}" if settings.username else " (anonymous)"
    if outcome == "denied":
        return line("broker", FAIL, f"{where} accepts the login{who} but refuses this node's publishes under its own "
                    f"name ({detail}): nothing it sends is delivered; this node is {site_id.hex()}",
                    f"under the per-device ACLs (docs/mqtt.md) each device logs in as its own site_id: set "
                    f"mqtt.username to {site_id.hex()} and its password, or fix the broker's ACL")
    if outcome == "ok":
        return line("broker", OK, f"{where} accepts this node's credentials{who}")
    if outcome == "refused":
        return line("broker", FAIL, f"{where} refused the connection{who}: {detail}",
                    "check mqtt.username and the password (/etc/ssp-agent/mqtt-password or SSP_MQTT_PASSWORD), and "
                    "that the broker's password file and ACL list this device (docs/mqtt.md)")
    return line("broker", FAIL, f"{where} unreachable: {detail}",
                "check the network, the broker's address and port, and TLS files; `run` keeps retrying meanwhile")


def check_clock(node, now_ms: int) -> dict:
    """The node's clock against the wall clock, as agent/clockstate.py judges it:
    FAIL when the node's HLC is far ahead of the wall clock or the wall clock is behind the
    node's own evidence (it was set back: writes are stamped ahead of real time and fresh peers
    reject them); WARN when no sync source vouches for the wall clock."""
    from . import clockstate
    a = clockstate.assess(node, now_ms)
    detail = {k: a[k] for k in ("state", "trusted", "source", "sync", "now_ms", "evidence_ms", "hlc",
                                "behind_ms", "ahead_ms", "signing_cap_ms")}
    if a["behind_ms"] > clockstate.FAR_MS or a["state"] == "behind":
        behind = a["behind_ms"] if a["behind_ms"] > clockstate.FAR_MS else (a["evidence_ms"] or now_ms) - now_ms
        return line("clock", FAIL, f"the wall clock is {_ago(behind)} behind this node's clock (its HLC "
                    f"{a['hlc']} or its last trustworthy reading): it was set back", a["hint"] or
                    "fix the clock (timedatectl); writes are stamped ahead of it until real time catches up",
                    **detail)
    if not a["trusted"]:
        return line("clock", WARN, f"wall clock not trusted ({a['state']}): no sync source says it is synchronised"
                    + (f", and it reads {_ago(a['ahead_ms'])} past the last trustworthy reading" if a["state"] == "ahead"
                       else ""), a["hint"], **detail)
    if a["state"] == "no_evidence":
        return line("clock", WARN, "wall clock trusted, but this home has no trustworthy reading recorded yet",
                    a["hint"], **detail)
    return line("clock", OK, f"wall clock trusted ({a['source']}); the node's HLC is {a['hlc']}", **detail)


def check_disk(node) -> dict:
    from .store.db import LOW_SPACE_BYTES, free_bytes
    used, budget = node.store_bytes(), node.profile.disk_budget_bytes
    frac = used / budget if budget else 0.0
    free = free_bytes(node.home)
    detail = {"store_bytes": used, "budget_bytes": budget, "free_bytes": free}
    msg = f"store {used / 2**20:.1f} MiB of {budget / 2**20:.0f} MiB budget ({frac:.0%})" + \
        (f"; {free / 2**20:.0f} MiB free on the filesystem" if free is not None else "")
    hint = "shorten the profile's horizons, run `ssp-agent evict --auto`, or move to a larger profile"
    if frac >= 1:
        return line("disk", FAIL, msg + ": over budget", hint, **detail)
    # Below LOW_SPACE_BYTES a write fails as a full disk (events, answers, cursors): the node is down.
    if free is not None and free < LOW_SPACE_BYTES:
        return line("disk", FAIL, msg + ": the filesystem is full", "free space on the filesystem (`ssp-agent "
                    "evict --auto` frees the store's own with its reserve)", **detail)
    if free is not None and free < max(budget - used, 0):
        return line("disk", WARN, msg + ": less free space than the budget still allows", "free space on the "
                    "filesystem or lower the budget", **detail)
    if frac >= node.profile.warn_fraction:
        return line("disk", WARN, msg + ": near the budget", hint, **detail)
    return line("disk", OK, msg, **detail)


def peer_lags(node) -> list[dict]:
    """Per trusted peer (not retired): events it has not confirmed (from its reported applied
    watermarks, sync_state.peer_lag), and how old the oldest unconfirmed own event is."""
    from .store import reports, sync_state as st
    out = []
    try:
        peers = reports.member_peers(node.conn, node.keyring, node.site_id)
        counts = st.group_counts(node.conn) if peers else []   # one pass over the log for every peer
        # A retired device's events are frozen history that no node ever receives from their origin
        # again: a device that joined after the retirement (its successor, docs/operations.md §3)
        # never reports them, so they are not awaited from anyone.
        counts = [(s, q, n) for s, q, n in counts if (node.keyring.get(s) or (None, None))[1] is None]
    except Exception:
        return out
    for p in peers:
        try:
            behind = st.peer_lag(node.conn, p, counts)
            wms = st.peer_watermarks(node.conn, p)
        except Exception:   # an older layout in a read view: nothing reported yet
            behind, wms = None, {}
        oldest = None
        if behind:
            # The oldest own event above what the peer reported for this node's site, per table.
            oldest = reports.oldest_unconfirmed(node.conn, node.site_id, wms)
        out.append({"peer": p.hex(), "behind_events": behind, "reported": bool(wms), "oldest_unconfirmed_ms": oldest})
    return out


def check_peers(node, now_ms: int) -> list[dict]:
    lags = peer_lags(node)
    if not lags:
        return [line("peers", WARN, "no trusted peer in the keyring", "add peers (manifest, `peer add`, or vouch records)")]
    out = []
    for p in lags:
        name = f"peer {p['peer'][:8]}"
        if not p["behind_events"]:
            out.append(line(name, OK, "has confirmed everything this node holds", **p))
            continue
        age = now_ms - p["oldest_unconfirmed_ms"] if p["oldest_unconfirmed_ms"] else None
        msg = f"has not confirmed {p['behind_events']} event(s)" + \
            (f"; the oldest of this node's own is {_ago(age)} old" if age is not None else "") + \
            ("" if p["reported"] else "; no watermark report received from it")
        hint = ("is it online and syncing? watermark reports are kept only over a secure binding (docs/mqtt.md)"
                if not p["reported"] else "is it online and syncing? `ssp-agent status` on it")
        lagging = age is None or age > PEER_LAG_WARN_MS or not p["reported"]
        out.append(line(name, WARN if lagging else OK, msg, hint, **p))
    return out


def check_faults(node, now_ms: int) -> dict:
    since = now_ms - FAULT_WINDOW_MS
    from .store import reports
    rows = reports.surfaced_since(node.conn, since)
    faults = {f"{k}:{r}": n for k, r, n in rows if k in FAULT_KINDS}
    if faults:
        return line("faults", WARN, "surfaced in the last 24 h: " + ", ".join(f"{k} ×{n}" for k, n in faults.items()),
                    "`ssp-agent events` lists them with detail (docs/apply.md)", counts=faults)
    return line("faults", OK, "nothing surfaced in the last 24 h that needs attention")


def run_checks(home: Path, broker_settings, timeout: float = 5.0, now_ms: int | None = None) -> list[dict]:
    now_ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    first, node = check_home(home)
    lines = [first]
    if node is None:
        lines.append(check_broker(broker_settings, None, timeout))
        return lines
    try:
        lines.append(check_keystore(node))
        lines.append(check_broker(broker_settings, node.site_id, timeout, node.mesh_id))
        lines.append(check_clock(node, now_ms))
        lines.append(check_disk(node))
        lines.extend(check_peers(node, now_ms))
        lines.append(check_faults(node, now_ms))
    finally:
        node.close()
    return lines


def render_text(lines: list[dict]) -> str:
    out = []
    for ln in lines:
        out.append(f"{ln['status']:<4}  {ln['check']:<14} {ln['message']}")
        if ln.get("hint"):
            out.append(f"{'':<20} hint: {ln['hint']}")
    w = worst(lines)
    out.append(f"{w}: {sum(ln['status'] == OK for ln in lines)} ok, {sum(ln['status'] == WARN for ln in lines)} "
               f"warning(s), {sum(ln['status'] == FAIL for ln in lines)} failure(s)")
    return "\n".join(out) + "\n"


def to_json(lines: list[dict]) -> str:
    return json.dumps({"worst": worst(lines), "exit": EXIT[worst(lines)], "checks": lines}, sort_keys=True)
