"""Metrics in the Prometheus text format, written to a file for node_exporter's
textfile collector (no port is opened): `run --metrics-file PATH`, `sync --metrics-file PATH`,
`ssp-agent metrics --out PATH`. The file is replaced atomically (a temporary file in the same
directory, fsync, rename), so the collector never reads half of it; the temporary name does not
end in `.prom`, so the collector ignores it. docs/operations.md lists every metric."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from .store import counters, db, reports


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples) -> None:
        """samples: [(labels dict, value)]; written even when empty (HELP/TYPE only)."""
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")


def event_labels(counts: dict[str, int]) -> dict[tuple[str, str], int]:
    """(origin, outcome) -> n from the `events` counter's `origin:outcome` keys. The outcome is
    after the last colon; a store's `peer:<site_id>` origins (the log's tag, counted so before the
    path was) are folded into `remote`: a label carries a documented value, never a site id."""
    out: dict[tuple[str, str], int] = {}
    for key, n in counts.items():
        origin, _, outcome = key.rpartition(":")
        if origin.startswith("peer:"):
            origin = "remote"
        out[(origin, outcome)] = out.get((origin, outcome), 0) + n
    return out


def render(node, run_stats: dict | None = None, now_s: float | None = None) -> str:
    """The node's metrics; `run_stats` (Runner.stats of a running `run`) adds the process's counters."""
    from .health import peer_lags
    o = _Out()
    site = node.site_id.hex()
    ev = counters.read(node.conn, "events")
    o.metric("ssp_events_total", "counter",
             "Events through the apply path, by origin (local; mqtt, serial, mailbox: the path they came by; released: "
             "held events applied once their table appeared; remote: a peer's, path not recorded) and outcome "
             "(applied, duplicate, dropped, rejected, held).",
             [({"origin": o_, "outcome": k_}, n) for (o_, k_), n in sorted(event_labels(ev).items())])
    o.metric("ssp_events_retained", "gauge", "Events in the retained log.",
             [({}, db.log_count(node.conn))])
    o.metric("ssp_events_held", "gauge", "Events held for a table this node does not have (§13.6 row 1).",
             [({}, db.held_total(node.conn))])
    o.metric("ssp_ignored_columns_total", "counter",
             "Events whose payload carried a column this node's schema does not have, per table and column "
             "(the §13.6 meter).",
             [({"table": q, "column": c}, n) for q, c, n in reports.ignored_columns(node.conn)])
    o.metric("ssp_surfaced_rows", "gauge", "Rows in the surfaced record (`ssp-agent events`), by kind.",
             [({"kind": k}, n) for k, n in reports.surfaced_by_kind(node.conn)])
    lags = peer_lags(node)
    o.metric("ssp_peer_lag_events", "gauge",
             "Events this node holds that the peer's reported applied watermarks do not cover.",
             [({"peer": p["peer"]}, p["behind_events"]) for p in lags if p["behind_events"] is not None])
    now_ms = int((time.time() if now_s is None else now_s) * 1000)
    o.metric("ssp_peer_lag_seconds", "gauge",
             "Age of the oldest own event the peer has not confirmed (0: none).",
             [({"peer": p["peer"]}, round((now_ms - p["oldest_unconfirmed_ms"]) / 1000, 3)
               if p["oldest_unconfirmed_ms"] else 0) for p in lags])
    used, budget = node.store_bytes(), node.profile.disk_budget_bytes
    o.metric("ssp_store_bytes", "gauge", "Store size (SQLite file and WAL).", [({}, used)])
    o.metric("ssp_store_budget_bytes", "gauge", "The profile's disk budget for the store.", [({}, budget)])
    o.metric("ssp_store_budget_ratio", "gauge", "Store size over its budget (1: at the budget).",
             [({}, round(used / budget, 6) if budget else 0)])
    o.metric("ssp_sync_runs_total", "counter", "`sync --once` runs, by outcome (ok, unreachable, refused, failed).",
             [({"outcome": k}, n) for k, n in sorted(counters.read(node.conn, "sync_runs").items())])
    if run_stats is not None:
        for key, name, help_ in (("batch_cycles", "ssp_run_batch_cycles_total", "Batch cycles of this `run` process."),
                                 ("bodies_pushed", "ssp_run_bodies_pushed_total", "Sync bodies pushed by this `run`."),
                                 ("bodies_received", "ssp_run_bodies_received_total", "Sync bodies received by this `run`."),
                                 ("answers", "ssp_run_answers_total", "Answers received for pushed bodies."),
                                 ("unanswered", "ssp_run_unanswered_total", "Pushed bodies that expired unanswered."),
                                 ("rejected_bodies", "ssp_run_refused_bodies_total", "Received bodies refused whole."),
                                 ("events_pushed", "ssp_run_events_offered_total", "Events offered to peers."),
                                 ("events_acknowledged", "ssp_run_events_acknowledged_total",
                                  "Offered events the peers answered for."),
                                 ("evictions", "ssp_run_evictions_total", "Eviction jobs run.")):
            o.metric(name, "counter", help_, [({}, int(run_stats.get(key, 0)))])
    o.metric("ssp_metrics_timestamp_seconds", "gauge", "When this file was written.",
             [({"site_id": site}, round(now_ms / 1000, 3))])
    return "\n".join(o.lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` in one rename (readers see the old or the new file, never half)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)   # the collector usually runs as another user
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# The CLI verbs that sync (`sync --once`, `run`, over MQTT or a serial line) share these.
def count_sync_run(node, outcome: str, args) -> None:
    """A `sync --once` run's outcome, durable (the metrics' ssp_sync_runs_total), and the metrics file."""
    import sqlite3

    from .store import db
    try:
        with db.transaction(node.conn):
            counters.bump(node.conn, "sync_runs", {outcome: 1})
    except sqlite3.Error as e:   # e.g. a full disk: the run's own outcome matters more than its count
        logging.getLogger("ssp_agent").warning("could not count the sync run: %s", e)
    write_metrics_file(node, args.metrics_file, None)


def write_metrics_file(node, path, run_stats) -> None:
    if not path:
        return
    try:
        write_atomic(Path(path), render(node, run_stats))
    except OSError as e:   # the metrics are a window, never a reason to stop syncing
        logging.getLogger("ssp_agent").warning("cannot write metrics to %s: %s", path, e)
