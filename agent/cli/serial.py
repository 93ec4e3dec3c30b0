"""`ssp-agent sync --serial PORT [--baud N] [--once]` and the serial ports of `ssp-agent run
--serial PORT [--serial PORT ...] [--broker URL ...]` (docs/cli.md "Sync";
docs/serial.md). The parser and `run` are agent/cli/mqtt.py's (`sync` and `run` take --broker and
--serial; `run` goes through the one runtime loop, agent/runtime.py, whatever it serves: one
line, several (a gateway), and MQTT beside them when --broker is given); this module checks the
serial flags, opens the ports and runs `sync --serial --once`."""
from __future__ import annotations

_MQTT_ONLY = ("broker", "ca_file", "cert_file", "key_file", "username", "password_file", "flush_cadence")


def check(args, once: bool) -> None:
    """Refused (exit 2) before anything opens: flags that do not go with --serial."""
    from .common import Refused
    names = list(args.serial)
    given = [f"--{k.replace('_', '-')}" for k in _MQTT_ONLY if getattr(args, k, None)]
    if once:
        if given:
            raise Refused(f"{', '.join(given)} apply to MQTT; sync --serial syncs over the line alone")
        if len(names) > 1:
            raise Refused("sync --serial takes one port; `run` serves several (a gateway)")
    else:
        if given and not args.broker:
            raise Refused(f"{', '.join(given)} apply to MQTT: give --broker too to serve MQTT beside the serial lines")
        if len(set(names)) != len(names):
            raise Refused("a serial port is named twice")
    if args.baud is not None and args.baud <= 0:
        raise Refused("--baud must be a positive number of bits per second (e.g. 115200)")


def open_ports(args, node, once: bool) -> list:
    """A SerialPort per --serial, opened; Fault (exit 1) naming the first that cannot be."""
    from .common import Fault
    from ..sync import SyncDriver
    from ..transport.serial import SerialError, SerialPort
    baud = args.baud or int(node.profile.serial_baud)
    ports: list = []
    try:
        for name in args.serial:
            ports.append(SerialPort(node, name, baud, SyncDriver, realtime=not args.no_realtime,
                                    secure=bool(args.secure_binding), cadence_s=args.cadence, once=once))
    except SerialError as e:
        for p in ports:
            p.close()
        raise Fault(str(e)) from None
    return ports


def sync_once(args) -> int:
    """`sync --serial PORT --once`: one full exchange in both directions, its summary printed."""
    from .common import EXIT_OK, Fault, open_node, emit
    from ..metrics import count_sync_run
    from ..transport.serial import SerialError
    check(args, once=True)
    node = open_node(args)
    try:
        (port,) = open_ports(args, node, once=True)
        try:
            try:
                summary = port.sync_once(timeout_s=args.timeout)
            except SerialError as e:
                count_sync_run(node, "failed", args)
                raise Fault(str(e)) from None
            count_sync_run(node, "ok", args)
            emit(summary)
            return EXIT_OK
        finally:
            port.close()
    finally:
        node.close()
