"""`ssp-agent sync --broker mqtt://HOST:PORT [--once]` and `ssp-agent run` (docs/cli.md "Sync").

Without --broker (nor SSP_MQTT_BROKER, nor [mqtt] broker), `sync --once` is refused (it would
sync with nobody); `run` starts a private mosquitto on a free loopback port for the duration of
the command (useful on a single machine and in the demo; a device normally names its gateway).
TLS and credentials: --ca-file/--cert-file/--key-file/--username, password from
$SSP_MQTT_PASSWORD or --password-file (never on the command line). The node's device profile
gives the defaults: cadence, events per body, body limit, session expiry, eviction interval.
`--secure-binding` (or SSP_MQTT_SECURE_BINDING=1) only when the broker enforces per-device ACLs."""
from __future__ import annotations

import logging
import os
import sys

from .. import stopsignal
from .args import interval_arg, positive_int_arg, seconds_arg


def _add_common(s) -> None:
    s.add_argument("--serial", metavar="PORT", action="append",
                   help="sync over this serial line instead of a broker (e.g. /dev/ttyUSB0; docs/serial.md); "
                        "run: repeat it to serve several lines, and give --broker to serve MQTT too (a gateway)")
    s.add_argument("--baud", type=positive_int_arg, default=None,
                   help="--serial: line rate in bits per second (default: the device profile's [serial] baud)")
    s.add_argument("--broker", help="mqtt://HOST:PORT or mqtts://HOST:PORT (default: SSP_MQTT_BROKER, then "
                                    "[mqtt] broker in agent.toml; `sync --once` without one is refused, `run` "
                                    "starts a private mosquitto on a free loopback port for its own duration)")
    s.add_argument("--cadence", type=interval_arg, default=None,
                   help="seconds between batch cycles (default: the device profile's cadence_s)")
    s.add_argument("--no-realtime", action="store_true", help="advertise supports_realtime: false; batch only")
    s.add_argument("--flush-cadence", type=interval_arg, default=None,
                   help="realtime pushes on this fixed cadence (seconds) instead of at production (§33.3)")
    s.add_argument("--ca-file", help="CA bundle for TLS (implies TLS)")
    s.add_argument("--cert-file", help="client certificate for mutual TLS")
    s.add_argument("--key-file", help="client private key for mutual TLS")
    s.add_argument("--username", help="broker username (password from $SSP_MQTT_PASSWORD or --password-file)")
    s.add_argument("--password-file", help="file holding the broker password")
    s.add_argument("--secure-binding", action="store_true", default=None,
                   help="treat the broker as authenticating senders: ONLY when the broker enforces per-device "
                        "credentials and ACLs that pin inbox topics to the device (docs/mqtt.md); then received "
                        "streams advance applied watermarks and peers' reports are used (also "
                        "SSP_MQTT_SECURE_BINDING=1)")
    s.add_argument("--connect-timeout", type=seconds_arg, default=10.0,
                   help="seconds to wait for the broker to accept the connection (default 10)")
    s.add_argument("--metrics-file", metavar="PATH",
                   help="write metrics (Prometheus text format) here for node_exporter's textfile collector: "
                        "`run` every --metrics-interval seconds, `sync --once` after its cycle (replaced atomically)")
    s.add_argument("--metrics-interval", type=interval_arg, default=15.0, help="run: seconds between metrics writes")


def register(sub, mailbox_sub) -> None:
    s = sub.add_parser("sync", help="sync with peers through an MQTT broker or over a serial line (batch + realtime)")
    _add_common(s)
    s.add_argument("--once", action="store_true",
                   help="one full cycle (push what each cursor selects, take in what waits), print JSON, exit")
    s.add_argument("--timeout", type=seconds_arg, default=None,
                   help="--once: longest wait for answers in seconds (default 20; --serial: the profile's [serial] timeout_s)")
    s.set_defaults(fn=cmd_sync)
    s = sub.add_parser("run", help="the long-running node: MQTT (or --serial) sync until SIGTERM/SIGINT")
    _add_common(s)
    s.set_defaults(fn=cmd_run, once=False)


def _config(args) -> dict:
    """The configuration file's [mqtt] table (agent/config.py), read once per command."""
    from .common import Refused
    from ..config import ConfigError, load
    if not hasattr(args, "_config"):
        try:
            args._config = load()
        except ConfigError as e:
            raise Refused(str(e)) from None
    return args._config["mqtt"]


def config_from(args, flag: str, env: str):
    """A setting: the flag, else the environment, else the configuration file (flags win)."""
    return getattr(args, flag, None) or os.environ.get(env) or _config(args).get(flag)


def mqtt_settings(args):
    from .common import Refused
    from ..config import credential_password
    from ..runner import settings_from_env
    password = None
    password_file = args.password_file
    if not password_file and not os.environ.get("SSP_MQTT_PASSWORD"):
        password = credential_password()   # systemd's LoadCredential=mqtt-password (docs/systemd.md)
        if password is None:
            password_file = _config(args).get("password_file")
    if password_file:
        from .common import PASSWORD_LIMIT, read_input
        password = read_input(password_file, PASSWORD_LIMIT, "the password file", text=True).strip()
    try:
        return settings_from_env(args.broker, ca_file=config_from(args, "ca_file", "SSP_MQTT_CA_FILE"),
                                 cert_file=config_from(args, "cert_file", "SSP_MQTT_CERT_FILE"),
                                 key_file=config_from(args, "key_file", "SSP_MQTT_KEY_FILE"),
                                 username=config_from(args, "username", "SSP_MQTT_USERNAME"), password=password,
                                 prefix=config_from(args, "prefix", "SSP_MQTT_PREFIX"))
    except ValueError as e:
        raise Refused(str(e)) from None


def _go(args, once: bool) -> int:
    if args.serial:
        return _go_serial(args, once)
    from .common import EXIT_OK, Fault, Refused, open_node, emit, use_reserve
    from ..metrics import count_sync_run
    broker = None
    args.broker = config_from(args, "broker", "SSP_MQTT_BROKER")   # flag, environment, /etc/ssp-agent/agent.toml
    if once and not args.broker:
        # a private broker would have nobody to sync with: exit 0 would say it synced
        raise Refused("sync --once needs a broker: give --broker mqtt://HOST:PORT (or mqtts://), set "
                      "SSP_MQTT_BROKER, or set [mqtt] broker in /etc/ssp-agent/agent.toml (docs/mqtt.md)")
    # the home first: a refused home must not leave a private mosquitto running behind it
    if not once:
        use_reserve(args.home, "run")   # its first turn evicts
    node = open_node(args)
    try:
        if not args.broker:
            from ..transport.broker import Broker, BrokerError   # only for a private mosquitto (start-up)
            try:
                broker = Broker().start()
            except BrokerError as e:
                raise Fault(str(e)) from None
            args.broker = broker.url
            print(f"ssp-agent: no --broker given; started a private mosquitto at {broker.url}", file=sys.stderr)
        r = open_runner(args, node, once)
        try:
            if once:
                try:
                    summary = r.sync_once(timeout_s=20.0 if args.timeout is None else args.timeout)
                except BaseException:
                    count_sync_run(node, "failed", args)
                    raise
                if r.link.denied:
                    count_sync_run(node, "refused", args)
                    raise Refused(denied_message(r.link.denied, r.settings.username, node.site_id))
                count_sync_run(node, "ok", args)
                emit(summary)
                return refused_bodies_told(r, summary)
            return run_runtime(args, node, runner=r)
        finally:
            r.close()
    finally:
        node.close()
        if broker is not None:
            broker.close()


def _go_serial(args, once: bool) -> int:
    """`sync --serial PORT --once`, or `run --serial PORT [--serial PORT ...] [--broker URL]`:
    the lines, and MQTT beside them only when --broker is given on the command line (a device
    whose configuration file names a broker and that is told to sync over a cable syncs over the
    cable)."""
    from . import serial as serial_verbs
    if once:
        return serial_verbs.sync_once(args)
    from .common import open_node, use_reserve
    serial_verbs.check(args, once=False)
    use_reserve(args.home, "run")   # its first turn evicts
    node = open_node(args)
    try:
        ports = serial_verbs.open_ports(args, node, once=False)
        try:
            logging.getLogger("ssp_agent.serial").setLevel(logging.INFO)  # ports lost and back
            runner = open_runner(args, node, once=False) if args.broker else None
            try:
                return run_runtime(args, node, runner=runner, ports=ports)
            finally:
                if runner is not None:
                    runner.close()
        finally:
            for p in ports:
                p.close()
    finally:
        node.close()


def open_runner(args, node, once: bool):
    """The MQTT Runner for `sync --once` or `run` (alone or beside serial ports), started: connected,
    or for `run` retrying a broker that is down. Fault (exit 1) when the broker refuses us, or
    for `--once` when it does not answer."""
    from .common import Fault
    from ..metrics import count_sync_run
    from ..runner import RunConfig, Runner
    from ..transport.mqtt import TransportError
    prof = node.profile
    secure = args.secure_binding if args.secure_binding is not None else \
        os.environ.get("SSP_MQTT_SECURE_BINDING", "").lower() in ("1", "true", "yes") \
        if "SSP_MQTT_SECURE_BINDING" in os.environ else bool(_config(args).get("secure_binding", False))
    cfg = RunConfig.from_profile(prof, cadence_s=args.cadence, realtime=not args.no_realtime,
                                 flush_cadence_s=args.flush_cadence, secure=secure)
    # `--once`: a wake-sync-sleep device runs `evict --auto` on its own timer; `run`: the runtime
    # loop runs the profile's eviction job for every transport (agent/runtime.py).
    cfg.eviction_interval_s = None
    if not once:
        logging.getLogger("ssp_agent.runner").setLevel(logging.INFO)  # eviction reports, refused bodies
    settings = mqtt_settings(args)
    settings.body_limit_bytes = int(prof.body_limit_bytes)
    settings.session_expiry_s = int(prof.session_expiry_s)
    settings.max_events = int(prof.batch_limit)
    settings.presence = getattr(prof, "presence", "mesh")
    try:
        r = Runner(node, settings, cfg)
    except TransportError as e:
        raise Fault(str(e)) from None
    if not r.start(args.connect_timeout, should_stop=None if once else stopsignal.requested):
        if not once and stopsignal.requested():
            return r   # stopped while connecting: the loop ends at once, with its summary
        err = r.link.last_error or f"no answer from {args.broker} within {args.connect_timeout}s"
        # `run` on a device that booted before its gateway keeps trying (the link's backoff) and
        # serves its control socket meanwhile; systemd restarts are a backstop, not the plan.
        # A broker that refuses us (credentials, ACL) needs a human: exit 1, as `--once` always does.
        if once or err.startswith("broker refused"):
            r.link.close(clear_presence=False)
            if once:
                count_sync_run(node, "unreachable", args)
            raise Fault(f"broker unreachable: {err}")
        print(f"ssp-agent: broker unreachable ({err}); run keeps retrying", file=sys.stderr)
    return r


def refused_bodies_told(r, summary: dict) -> int:
    """`sync --once` names the bodies it refused on stderr (a wake's JSON is rarely read), and a
    wake that refused every body it received is a refusal (exit 2), not a sync: a device whose
    decoder could not read its peers' bodies refused each as `malformed_cbor` and exited 0."""
    from .common import EXIT_OK, EXIT_REFUSED
    n, got = summary["refused_bodies"], summary["bodies_received"]
    if not n:
        return EXIT_OK
    reasons = ", ".join(f"{k.split(':', 1)[1]} x{v}" if v > 1 else k.split(":", 1)[1]
                        for k, v in sorted(r.stats.items()) if k.startswith("rejected:") and v)
    see = "; `ssp-agent events` lists them"
    if n >= got:
        print(f"ssp-agent: sync --once refused every body it received ({n}): {reasons}{see}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"ssp-agent: sync --once refused {n} of {got} bodies received: {reasons}{see}", file=sys.stderr)
    return EXIT_OK


def denied_message(n: int, username: str | None, site: bytes) -> str:
    """What a device is told when the broker accepted its login but refused its publishes."""
    who = f"account {username}" if username else "anonymous login"
    return (f"the broker accepted the {who} but refused {n} publish(es) of this device (Not authorized): "
            f"nothing it sent was delivered. This device is {site.hex()}; under the per-device ACLs "
            f"(docs/mqtt.md) it must log in as its own site_id with its own password: set mqtt.username to "
            f"{site.hex()} and its password (or fix the broker's ACL)")


def run_runtime(args, node, runner=None, ports=()) -> int:
    """`run`: the one runtime loop (agent/runtime.py) over the runner and the serial ports until
    SIGTERM/SIGINT; prints the summary."""
    from . import run_forwarded
    from .common import EXIT_OK, emit
    from ..runtime import Runtime
    stopsignal.catch()   # installed by `main` already; again for a caller that dispatches `run` itself
    interval = float(getattr(node.profile, "eviction_interval_s", 0) or 0) or None
    rt = Runtime(node, runner=runner, ports=ports, broker_url=args.broker if runner is not None else None,
                 forward=run_forwarded, eviction_interval_s=interval, metrics_file=args.metrics_file,
                 metrics_interval_s=args.metrics_interval)
    stopsignal.on_stop(rt.wake)
    try:
        for p in ports:
            print(f"ssp-agent: syncing over {p.port} at {p.baud} baud", file=sys.stderr)
        emit(rt.run(stopsignal.requested))
    finally:
        stopsignal.on_stop(None)
    return EXIT_OK


def cmd_sync(args) -> int:
    return _go(args, args.once)


def cmd_run(args) -> int:
    from .common import EXIT_OK, emit
    from ..hometurn import Stopped
    args.should_stop = stopsignal.requested   # waiting for the home ends on SIGTERM too
    try:
        return _go(args, False)
    except Stopped as e:
        # never held the home, so nothing ran: the summary says so (exit 0, as any stop)
        emit({"started": False, "reason": str(e), "pushed": 0, "applied": 0})
        return EXIT_OK
