"""`ssp-agent sync --serial PORT [--baud N] [--once]` and `ssp-agent run --serial PORT`
(cli-contract.md "sync over a serial line"; docs/serial.md). The parser is cli_mqtt's (`sync`
and `run` take either --broker or --serial); this module runs the serial form."""
from __future__ import annotations

import os
import signal
import sys

_MQTT_ONLY = ("broker", "ca_file", "cert_file", "key_file", "username", "password_file", "flush_cadence")


def go(args, once: bool) -> int:
    from .cli import EXIT_OK, Fault, Refused, _open, emit
    from .transport.serial import SerialError, SerialPort
    given = [f"--{k.replace('_', '-')}" for k in _MQTT_ONLY if getattr(args, k, None)]
    if given:
        raise Refused(f"{', '.join(given)} apply to MQTT; --serial syncs over the line alone")
    if args.baud is not None and args.baud <= 0:
        raise Refused("--baud must be a positive number of bits per second (e.g. 115200)")
    node = _open(args)
    try:
        baud = args.baud or int(node.profile.serial_baud)
        secure = bool(args.secure_binding)
        try:
            port = SerialPort(node, args.serial, baud, realtime=not args.no_realtime, secure=secure,
                              cadence_s=args.cadence, once=once)
        except SerialError as e:
            raise Fault(str(e)) from None
        try:
            if once:
                from .metrics import count_sync_run
                try:
                    summary = port.sync_once(timeout_s=args.timeout)
                except SerialError as e:
                    count_sync_run(node, "failed", args)
                    raise Fault(str(e)) from None
                count_sync_run(node, "ok", args)
                emit(summary)
                return EXIT_OK
            return _run(port, node, args.serial, args)
        finally:
            port.close()
    finally:
        node.close()


def _run(port, node, name: str, args=None) -> int:
    """`run --serial`: the loop, and between its steps the verbs other commands forward through
    the control socket (agent/control.py), run on this thread that owns the node."""
    from .cli import EXIT_OK, emit
    from .cli import run_forwarded
    from .control import ControlServer
    from .transport.serial import _mono, _wall
    stop = {"v": False}

    def _stop(*_a):
        stop["v"] = True
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)

    def status_extra() -> dict:
        return {"pid": os.getpid(), "serial": name, **port.endpoint.summary()}

    def execute(argv: list[str]) -> tuple[int, str, str]:
        res = run_forwarded(argv, node, status_extra)
        if res[0] == 0 and "write" in argv:
            port.endpoint.local_events(_mono(), _wall())  # realtime: the peer gets it at once (§33)
        return res

    from . import sdnotify
    from .metrics import write_metrics_file
    import time
    server = ControlServer(node.home, execute)
    watchdog = sdnotify.Watchdog()
    metrics_file = getattr(args, "metrics_file", None)
    interval = getattr(args, "metrics_interval", 15.0)
    nxt = {"t": 0.0}

    def serve() -> None:   # each turn of the line's loop: the watchdog, forwarded verbs, the metrics file
        watchdog.ping()
        server.serve()
        if metrics_file and time.monotonic() >= nxt["t"]:
            write_metrics_file(node, metrics_file, None)
            nxt["t"] = time.monotonic() + interval
    print(f"ssp-agent: syncing over {name} at {port.baud} baud", file=sys.stderr)
    sdnotify.notify(f"READY=1\nSTATUS=syncing over {name}\nMAINPID={os.getpid()}")   # systemd Type=notify
    try:
        summary = port.run(lambda: stop["v"], serve)
    finally:
        sdnotify.notify("STOPPING=1")
        server.close()
        write_metrics_file(node, metrics_file, None)
    emit(summary)
    return EXIT_OK
