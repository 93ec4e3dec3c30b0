"""`ssp-agent provision`: its arguments, and what it prints (docs/operations.md "Fleet workflow").
The work is agent/provision/: `bundle` and `flash` on the technician's machine (bundle.py,
image.py), `device-setup` and `enrol` on the device, run by firstboot.sh (enrolment.py). A
refusal there is exit 2, a failed step exit 1, each with its one line."""
from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

from .args import seconds_arg
from .common import EXIT_OK, Fault, Refused, emit, version


@contextlib.contextmanager
def _reported():
    """agent/provision's errors as the CLI's: a refusal exit 2, a fault exit 1 (same line)."""
    from ..provision.files import ProvisionFault, ProvisionRefused
    try:
        yield
    except ProvisionRefused as e:
        raise Refused(str(e)) from None
    except ProvisionFault as e:
        raise Fault(str(e)) from None


def register(sub, mailbox_sub) -> None:
    s = sub.add_parser("provision", help="provisioning bundles and Raspberry Pi OS images (docs/operations.md)")
    ps = s.add_subparsers(dest="provision_verb", metavar="ACTION")
    ps.required = True
    a = ps.add_parser("bundle", help="make a provisioning bundle for a device")
    a.add_argument("--out", required=True, help="the bundle directory to create (must not exist)")
    a.add_argument("--manifest", required=True, help="the mesh's provisioning manifest (TOML)")
    a.add_argument("--profile", default="pi-3-4", help="device profile (built-in name or .toml file)")
    a.add_argument("--keystore", help='keystore JSON for init on the device, e.g. {"kind":"pkcs11",...}; '
                                      "default: the profile's (a software keystore in the home)")
    a.add_argument("--wheelhouse", required=True,
                   help="the device's wheelhouse directory (tools/wheelhouse.sh; e.g. dist/wheelhouse/aarch64-cp311)")
    a.add_argument("--extras", default="", help='extras to install, e.g. "pkcs11"')
    a.add_argument("--broker", help="broker URL, e.g. mqtts://gateway.example:8883")
    a.add_argument("--ca-file", help="CA bundle the device verifies the broker with (copied)")
    a.add_argument("--username", help="a shared broker user name (default: each device's site_id, with a "
                                      "password the device makes; only its hash leaves the device)")
    a.add_argument("--password-file", help="the shared user name's password (copied; needs --username)")
    a.add_argument("--cert-file", help="client certificate (copied)")
    a.add_argument("--key-file", help="client key (copied, 0600)")
    a.add_argument("--secure-binding", action=argparse.BooleanOptionalAction, default=None,
                   help="devices run with the secure binding (docs/mqtt.md \"Authenticated or not\"): only when "
                        "the broker enforces per-device accounts and ACLs; default: on with per-device accounts "
                        "(no --username), off with a shared account")
    a.add_argument("--service", choices=["run", "timer"], default="run",
                   help="always-on `run` (ssp-agent.service) or wake-sync-sleep (ssp-agent-sync.timer)")
    a.add_argument("--clock-trusted", action="store_true", help="the device has a real-time clock: init does "
                   "not wait for NTP (docs/apply.md \"Clocks without an RTC\")")
    a.add_argument("--wait-clock", type=seconds_arg, default=600, help="seconds init waits for NTP per attempt")
    a.set_defaults(fn=cmd_bundle, home_optional=True)

    a = ps.add_parser("flash", help="write a bundle onto a Raspberry Pi OS image file (boot + root partitions)")
    a.add_argument("--image", required=True, help="the .img file (MBR: FAT boot partition, ext4 root)")
    a.add_argument("--bundle", required=True, help="the bundle directory made by `provision bundle`")
    a.add_argument("--hook", choices=["auto", "firstrun", "cloud-init"], default="auto",
                   help="first-boot hook: firstrun.sh on cmdline.txt (Bookworm) or cloud-init user-data "
                        "(Trixie-based); auto: cloud-init when the boot partition has user-data or meta-data")
    a.set_defaults(fn=cmd_flash, home_optional=True)

    a = ps.add_parser("device-setup", help="(on the device, run by firstboot.sh) /etc/ssp-agent and the enrolment unit")
    a.add_argument("--bundle", required=True, help="the bundle directory (/opt/ssp-agent/bundle on a device)")
    a.add_argument("--root", default="/", help="the device's root directory; every path written is under it")
    a.add_argument("--boot", help="the boot partition (default: ROOT/boot/firmware)")
    a.set_defaults(fn=cmd_device_setup, home_optional=True)

    a = ps.add_parser("enrol", help="(on the device, run by the enrolment unit) init, units, the enrolment file")
    a.add_argument("--bundle", required=True, help="the bundle directory (/opt/ssp-agent/bundle on a device)")
    a.add_argument("--root", default="/", help="the device's root directory; every path written is under it")
    a.add_argument("--boot", help="the boot partition (default: ROOT/boot/firmware)")
    a.set_defaults(fn=cmd_enrol, home_optional=True)



def cmd_bundle(args) -> int:
    from ..provision import bundle
    with _reported():
        out = bundle.make_bundle(
            Path(args.out), manifest=Path(args.manifest), profile=args.profile, keystore=args.keystore,
            wheelhouse=Path(args.wheelhouse), extras=args.extras, broker=args.broker, ca_file=args.ca_file,
            username=args.username, password_file=args.password_file, cert_file=args.cert_file,
            key_file=args.key_file, secure_binding=args.secure_binding, service=args.service,
            clock_trusted=args.clock_trusted, wait_clock=args.wait_clock, agent_version=version())
    emit(out)
    return EXIT_OK


def cmd_flash(args) -> int:
    from ..provision import image
    with _reported():
        out = image.flash(Path(args.image), Path(args.bundle), args.hook)
    emit(out)
    return EXIT_OK


def _boot(args) -> Path:
    """--boot, else the boot partition under --root (never the host's own when --root is given)."""
    from ..provision.files import under
    return Path(args.boot) if args.boot else under(Path(args.root), "/boot/firmware")


def cmd_device_setup(args) -> int:
    from ..provision import enrolment
    with _reported():
        out = enrolment.device_setup(Path(args.bundle), Path(args.root))
    emit(out)
    return EXIT_OK


def _service_install(argv: list[str]) -> tuple[int, str]:
    """`ssp-agent service install ...` run in this process, for enrolment: its exit status and what
    it said on stderr (its stdout is not the enrolment's)."""
    from .. import cli
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.dispatch(cli.build_parser().parse_args(argv))
    return rc, err.getvalue()


def cmd_enrol(args) -> int:
    from ..provision import enrolment
    try:
        from . import service  # noqa: F401
        install = _service_install
    except ImportError:   # a version without `service install`: the bundle's copies of the units
        install = None
    with _reported():
        card = enrolment.enrol(Path(args.bundle), Path(args.root), _boot(args), version(), install)
    emit(card)
    return EXIT_OK
