"""Device profiles (agent/profiles/*.toml, package data found through importlib.resources so an
install from the wheel has them): horizons per retention class, disk budget, sync limits and
the keystore. A node records the profile it was initialised with in its store; docs/cli.md documents
every key."""
from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .infile import InputRefused, read_text

DEFAULT_PROFILE = "pi-3-4"
SECURE_DELETE_MODES = ("on", "fast", "off")
_DURATION = re.compile(r"^\s*([0-9]{1,15})\s*(ms|s|m|h|d|w)\s*$")   # 15 digits: never a 4 300-digit int()
HORIZON_MAX_MS = 100 * 365 * 86_400_000   # longer is "forever" (and HLC arithmetic stays in 64 bits)
NUMBER_MAX = 10**9                         # no setting needs more (seconds: 31 years; counts, bytes, MB)
PROFILE_LIMIT = 1 << 20                    # a profile file is a few hundred bytes
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the key to fix."""


def parse_duration_ms(text: str, what: str) -> int:
    m = _DURATION.match(text) if isinstance(text, str) else None
    if not m:
        raise ProfileError(f"{what}: {text!r} is not a duration like 90s, 15m, 12h, 7d or 2w (or \"forever\" in [horizons])")
    ms = int(m.group(1)) * _UNIT_MS[m.group(2)]
    if ms > HORIZON_MAX_MS:
        raise ProfileError(f"{what}: {text!r} is longer than 100 years; say \"forever\" to keep history for good")
    return ms


@dataclass(frozen=True)
class Profile:
    name: str
    description: str = ""
    disk_budget_bytes: int = 1024 * 2**20
    warn_fraction: float = 0.8
    horizons_ms: dict[str, int] = field(default_factory=dict)  # retention class -> history kept
    eviction_interval_s: float = 1800
    cadence_s: float = 30
    batch_limit: int = 1000
    body_limit_bytes: int = 256 * 1024
    backfill_rows_per_cycle: int = 1000
    session_expiry_s: int = 7 * 86400
    presence: str = "mesh"              # [sync] whose MQTT presence to follow: "mesh" | "members" (docs/scale.md)
    keystore: dict = field(default_factory=lambda: {"kind": "software"})
    surfaced_limit: int = 100_000       # surfaced rows kept (store-enforced; docs/apply.md "Bounds")
    feed_retain: int = 100_000          # change-feed records kept (docs/client.md)
    records_limit: int = 10_000         # control records stored from others, in total
    records_limit_bytes: int = 16 * 2**20
    keep_full: tuple[str, ...] = ()  # retention classes listed as "forever": known, never evicted
    # [store] secure_delete: what SQLite does with a value the node overwrites or deletes (a
    # materialized row's superseded value, an evicted event): "on" zeroes it and every freed page,
    # "fast" zeroes it where that costs no extra write, "off" leaves it in free space (SQLite's own
    # default; docs/reliability.md "Superseded values")
    secure_delete: str = "on"
    # [serial]: the serial link (docs/serial.md "Settings")
    serial_baud: int = 115_200
    serial_batch_limit: int = 1000      # events per body over a serial line
    serial_frame_bytes: int = 1024      # largest link frame payload
    serial_window_bytes: int = 8192     # bytes unacknowledged at most (and receive credit)
    serial_keepalive_s: float = 1.0     # PING after this much silence from the other end
    serial_dead_s: float = 10.0         # silence that ends the link (a pulled cable)
    serial_timeout_s: float = 30.0      # sync --serial --once: wait this long for the other end
    serial_compress: bool = True        # offer per-message zlib (preset dictionary) in the link's HELLO

    def unknown_classes(self, classes) -> list[str]:
        """Retention classes this profile does not name. A profile with no horizons at all keeps
        everything (the gateway) and names none, so nothing is unknown to it; otherwise a class
        it does not list is most likely a typo, which would keep that table's history forever."""
        if not self.horizons_ms and not self.keep_full:
            return []
        return sorted({c for c in classes if c is not None and c not in self.horizons_ms and c not in self.keep_full})

    def as_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "disk_budget_bytes": self.disk_budget_bytes,
                "warn_fraction": self.warn_fraction, "horizons_ms": dict(self.horizons_ms),
                "eviction_interval_s": self.eviction_interval_s, "cadence_s": self.cadence_s,
                "batch_limit": self.batch_limit, "body_limit_bytes": self.body_limit_bytes,
                "backfill_rows_per_cycle": self.backfill_rows_per_cycle, "session_expiry_s": self.session_expiry_s,
                "keystore": dict(self.keystore), "surfaced_limit": self.surfaced_limit, "feed_retain": self.feed_retain,
                "records_limit": self.records_limit, "records_limit_bytes": self.records_limit_bytes,
                "keep_full": list(self.keep_full), "secure_delete": self.secure_delete,
                "serial_baud": self.serial_baud,
                "serial_batch_limit": self.serial_batch_limit, "serial_frame_bytes": self.serial_frame_bytes,
                "serial_window_bytes": self.serial_window_bytes, "serial_keepalive_s": self.serial_keepalive_s,
                "serial_dead_s": self.serial_dead_s, "serial_timeout_s": self.serial_timeout_s,
                "serial_compress": self.serial_compress}

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        return cls(**{**d, "horizons_ms": dict(d.get("horizons_ms", {})), "keystore": dict(d.get("keystore", {})),
                      "keep_full": tuple(d.get("keep_full", ()))})


_KNOWN = {"name", "description", "store", "horizons", "eviction", "sync", "keystore", "serial"}


def parse_profile(text: str, origin: str = "profile") -> Profile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{origin} is not valid TOML: {e}") from None
    except RecursionError:
        raise ProfileError(f"{origin} is nested too deeply") from None
    extra = set(doc) - _KNOWN
    if extra:
        raise ProfileError(f"{origin}: unknown keys {', '.join(sorted(extra))}")
    for section in ("store", "horizons", "eviction", "sync", "keystore", "serial"):
        if not isinstance(doc.get(section, {}), dict):
            raise ProfileError(f"{origin}: [{section}] must be a table")
    store, sync, evict = doc.get("store", {}), doc.get("sync", {}), doc.get("eviction", {})
    ser = doc.get("serial", {})

    def num(section: dict, key: str, default, kind=int, minimum=0, maximum=NUMBER_MAX):
        # NaN compares false with everything and infinity overflows int(): both refused here,
        # as is anything past a bound no setting needs (a duration of 30 years, 10^9 of a count)
        v = section.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not minimum <= v <= maximum:
            raise ProfileError(f"{origin}: {key} must be a number from {minimum} to {maximum}")
        return kind(v)

    hdoc = doc.get("horizons", {})
    keep_full = tuple(sorted(c for c, v in hdoc.items() if v == "forever"))
    horizons = {c: parse_duration_ms(v, f"{origin}: horizons.{c}") for c, v in hdoc.items() if v != "forever"}
    ks = doc.get("keystore", {"kind": "software"})
    if not isinstance(ks, dict) or ks.get("kind") not in ("software", "pkcs11", "serial"):
        raise ProfileError(f"{origin}: keystore.kind must be software, pkcs11 or serial")
    warn = num(store, "warn_fraction", 0.8, float)
    if not 0 < warn <= 1:
        raise ProfileError(f"{origin}: store.warn_fraction must be in (0, 1]")
    secure_delete = store.get("secure_delete", "on")
    if secure_delete not in SECURE_DELETE_MODES:
        raise ProfileError(f"{origin}: store.secure_delete must be one of {', '.join(SECURE_DELETE_MODES)}")
    presence = sync.get("presence", "mesh")
    if presence not in ("mesh", "members"):
        raise ProfileError(f"{origin}: sync.presence must be mesh or members")
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{origin}: name is required")
    return Profile(
        name=name, description=str(doc.get("description", "")),
        disk_budget_bytes=num(store, "disk_budget_mb", 1024, int, 1) * 2**20, warn_fraction=warn,
        horizons_ms=horizons, eviction_interval_s=num(evict, "interval_s", 1800, float, 1),
        cadence_s=num(sync, "cadence_s", 30, float, 0.05), batch_limit=num(sync, "batch_limit", 1000, int, 1),
        body_limit_bytes=num(sync, "body_limit_bytes", 256 * 1024, int, 1024),
        backfill_rows_per_cycle=num(sync, "backfill_rows_per_cycle", 1000, int, 1),
        session_expiry_s=num(sync, "session_expiry_s", 7 * 86400, int, 0, 2**32 - 1), keystore=dict(ks),
        presence=presence,
        surfaced_limit=num(store, "surfaced_limit", 100_000, int, 1),
        feed_retain=num(store, "feed_retain", 100_000, int, 1),
        records_limit=num(store, "records_limit", 10_000, int, 1),
        records_limit_bytes=int(num(store, "records_limit_mb", 16, float, 0.001) * 2**20), keep_full=keep_full,
        secure_delete=secure_delete,
        serial_baud=num(ser, "baud", 115_200, int, 50), serial_batch_limit=num(ser, "batch_limit", 1000, int, 1),
        serial_frame_bytes=min(65_535, num(ser, "frame_bytes", 1024, int, 64)),
        serial_window_bytes=num(ser, "window_bytes", 8192, int, 1024),
        serial_keepalive_s=num(ser, "keepalive_s", 1.0, float, 0.05), serial_dead_s=num(ser, "dead_s", 10.0, float, 0.2),
        serial_timeout_s=num(ser, "timeout_s", 30.0, float, 0.5), serial_compress=_flag(ser, "compress", True, origin))


def _flag(section: dict, key: str, default: bool, origin: str) -> bool:
    v = section.get(key, default)
    if not isinstance(v, bool):
        raise ProfileError(f"{origin}: {key} must be true or false")
    return v


def _builtin():
    """The built-in profiles: package data (agent/profiles/), also inside a zip or wheel install."""
    return resources.files(__package__).joinpath("profiles")


def builtin_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in _builtin().iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str | None) -> Profile:
    """A built-in profile by name (agent/profiles/NAME.toml) or a file by path; None gives the default."""
    ref = name_or_path or DEFAULT_PROFILE
    path = Path(ref)
    try:
        if path.suffix:
            text, origin = read_text(path, PROFILE_LIMIT, "profile"), str(path)
        else:
            res = _builtin().joinpath(f"{ref}.toml")
            text, origin = res.read_text(), f"profile {ref}"
    except InputRefused as e:          # a FIFO, a device, too large, not UTF-8 (agent/infile.py)
        raise ProfileError(str(e)) from None
    except OSError:
        names = ", ".join(builtin_profiles())
        raise ProfileError(f"no profile {ref!r} (built in: {names}; or give a path to a .toml file)") from None
    return parse_profile(text, origin)
