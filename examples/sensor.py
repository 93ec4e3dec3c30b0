"""A sensor on the device: a reading every interval, written through agent.client (docs/client.md
"Examples"). Works whether or not `ssp-agent run` holds the home; each reading is one signed event
that syncs to the mesh. The temperature is the SoC's (/sys/class/thermal) where there is one."""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from agent.client import Client

THERMAL = Path("/sys/class/thermal/thermal_zone0/temp")


def read_temp(i: int) -> float:
    try:
        return int(THERMAL.read_text()) / 1000.0
    except (OSError, ValueError):
        return round(20.0 + 2.0 * math.sin(i / 10), 2)   # no sensor here: a plausible curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("home", help="the node's home")
    p.add_argument("--table", default="app.readings")
    p.add_argument("--device", default="sensor-1")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between readings")
    p.add_argument("--count", type=int, default=0, help="stop after this many readings (0: never)")
    a = p.parse_args()
    with Client(a.home) as c:
        i, due = 0, time.monotonic()
        while not a.count or i < a.count:
            eid = c.write(a.table, {"device": a.device, "seq": int(time.time() * 1000)}, set={"temp": read_temp(i)})
            print(eid, flush=True)
            i += 1
            due += a.interval
            time.sleep(max(0.0, due - time.monotonic()))


if __name__ == "__main__":
    main()
