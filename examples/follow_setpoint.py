"""Follow a table a gateway writes and act on each change (docs/client.md "Examples"): a setpoint
per zone. Its cursor is kept in a file, so a restart resumes where it stopped and misses nothing.
A resurrection (a row a delete had removed, brought back by a later write, SSP/1 §13.2) and a
partial rebuild (history below the eviction horizon is gone, §13.4) are said, not hidden; a value
replaced since (catching up) is skipped, the record that replaced it follows; on a home older
than the feed, its first record says to re-read the table."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from agent.client import Client, CursorExpired, FellBehind


def act(rec: dict) -> str | None:
    """What this program does with one record; here it says what it would do."""
    if rec["kind"] == "rebuild":
        # the home held rows before it had the feed: those are in no record
        return "the feed starts here: re-read every setpoint"
    if rec["kind"] != "change":
        return f"{rec['kind']}: an event for {rec['table']} ({rec['reason']})"
    zone = rec["key"].get("zone")
    if not rec["exists"]:
        return f"zone {zone}: setpoint removed, back to the default"
    col = rec["columns"].get("target", {})
    if col.get("superseded"):
        return None   # replaced since: a later record carries the setpoint now in force
    target = col.get("value")
    note = ""
    if rec.get("partial"):
        note = f" (resurrected; history below horizon {rec['partial']['horizon']} is evicted: partial)"
    elif rec.get("resurrected"):
        note = " (resurrected)"
    return f"zone {zone}: setpoint {target}{note}"


def save(path: Path, cursor: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(cursor))
    os.replace(tmp, path)   # the cursor survives a crash whole or not at all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("home", help="the node's home")
    p.add_argument("--table", default="app.setpoints")
    p.add_argument("--cursor-file", default="setpoint.cursor", help="where the last cursor is kept")
    p.add_argument("--idle", type=float, help="exit after this many seconds without a change (default: never)")
    a = p.parse_args()
    cursor_file = Path(a.cursor_file)
    since = int(cursor_file.read_text()) if cursor_file.exists() else 0
    c = Client(a.home)
    while True:
        try:
            for rec in c.watch([a.table], since=since, idle_s=a.idle):
                said = act(rec)
                if said:
                    print(json.dumps({"cursor": rec["cursor"], "action": said}), flush=True)
                since = rec["cursor"]
                save(cursor_file, since)
            return
        except FellBehind as e:
            since = e.cursor   # cut off while busy: resume from the last record acted on
        except CursorExpired as e:
            print(json.dumps({"action": "cursor expired: re-read every setpoint", "head": e.head}), flush=True)
            since = e.head


if __name__ == "__main__":
    main()
