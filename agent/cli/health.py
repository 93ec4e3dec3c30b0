"""`ssp-agent check` and `ssp-agent metrics --out PATH` (agent/health.py,
agent/metrics.py). Both read the home through a read view: they write nothing to it and work
beside a running `run`."""
from __future__ import annotations

import sys
from pathlib import Path

from .args import seconds_arg
from ..health import EXIT


def register(sub, mailbox_sub) -> None:
    s = sub.add_parser("check", help="health check: home, keystore, broker, clock, disk, peers, faults "
                                     "(OK/WARN/FAIL; exit 0 all OK, 3 a warning, 4 a failure)")
    s.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    s.add_argument("--broker", help="broker to probe (default: SSP_MQTT_BROKER, then /etc/ssp-agent/agent.toml)")
    s.add_argument("--username", help="broker username (password from $SSP_MQTT_PASSWORD or --password-file)")
    s.add_argument("--password-file", help="file holding the broker password")
    s.add_argument("--ca-file", help="CA bundle for TLS (implies TLS)")
    s.add_argument("--cert-file", help="client certificate for mutual TLS")
    s.add_argument("--key-file", help="client private key for mutual TLS")
    s.add_argument("--timeout", type=seconds_arg, default=5.0, help="seconds to wait for the broker (default 5)")
    s.set_defaults(fn=cmd_check)
    s = sub.add_parser("metrics", help="write the node's metrics (Prometheus text format) for node_exporter's "
                                       "textfile collector")
    s.add_argument("--out", required=True, help="e.g. /var/lib/node_exporter/textfile_collector/ssp_agent.prom "
                                                "(replaced atomically); - for stdout")
    s.set_defaults(fn=cmd_metrics)


def cmd_check(args) -> int:
    from .mqtt import config_from, mqtt_settings
    from ..health import render_text, run_checks, to_json, worst
    args.broker = config_from(args, "broker", "SSP_MQTT_BROKER")
    settings = mqtt_settings(args) if args.broker else None
    lines = run_checks(Path(args.home).absolute(), settings, timeout=args.timeout)
    sys.stdout.write(to_json(lines) + "\n" if args.json else render_text(lines))
    return EXIT[worst(lines)]


def cmd_metrics(args) -> int:
    from .common import EXIT_OK
    from ..metrics import render, write_atomic
    from ..node import Node
    node = Node.open(Path(args.home), read_only=True)
    try:
        text = render(node)
    finally:
        node.close()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        write_atomic(Path(args.out), text)
    return EXIT_OK
