"""A node's home: making one (`init`, and undoing a failed or interrupted one), opening its
store and keystore, and the keystore configuration helpers (paths relative to the home, the PIN
kept out of the store, the keystore that seals the log at rest). The node (agent/node.py) builds
its state on what `open_parts` returns; nothing here reads or writes rows."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from firmware_bridge import KeyExists, KeystoreError, KeystoreUnavailable, SigningBridge, open_keystore, with_pin
from firmware_bridge import keytag
from firmware_bridge.errors import DeviceTimeout
from firmware_bridge.fsutil import atomic_write, fsync_dir
from firmware_bridge.journal import inspect as journal_inspect

from . import identity as ident
from .clockstate import now_ms
from .core.schema import TableDef, parse_manifest
from .errors import NodeError
from .nodeclock import wait_trusted_clock
from .produce import EVENT_KEY
from .profile import Profile, ProfileError, load_profile
from .store import atrest, db, migrations, rows as rowstore, sync_state

log = logging.getLogger("ssp_agent")

STORE_FILE = "store.sqlite"
IDENTITY_FILE = "identity.json"
# Present while `init` runs (what the home held before it, for undoing): an init cut short by
# a kill or a power cut is completed by the next one, which first removes what that one made
INIT_MARKER = "init.incomplete"


def begin_init(home: Path, manifest_text: str, keystore: dict | None, profile, clock_trusted: bool,
               wait_clock_s: float) -> tuple[Path, "Made", tuple]:
    """The checks `init` makes before anything is made, and what the home held before it
    (`Made`). Returns (the home made absolute, the note, the arguments of `make_home`)."""
    # Absolute: what the store records (keystore dir, PIN file) must not depend on the directory
    # `init` ran in; a systemd unit or cron starts the node from elsewhere.
    home = Path(home).absolute()
    interrupted = Made.interrupted(home)
    if interrupted is not None:
        log.warning("an earlier init of %s was cut short: removing what it made", home)
        interrupted.undo(keep_device_key=False)
    if (home / STORE_FILE).exists() or (home / IDENTITY_FILE).exists():
        raise NodeError(f"{home} already holds a node; choose an empty directory (a node is never re-initialised in place)")
    manifest = parse_manifest(manifest_text)
    try:
        prof = profile if isinstance(profile, Profile) else load_profile(profile)
    except ProfileError as e:
        raise NodeError(str(e)) from None
    check_retention(prof, manifest.tables)
    ks_conf = check_keystore_conf(dict(keystore or prof.keystore))
    # A node's first evidence of real time is the reading taken here: a wrong one would let
    # its first writes be stamped anywhere, so `init` waits for a trustworthy clock in strict
    # mode (first-boot enrolment, --wait-clock); elsewhere an unverifiable clock is accepted
    # with a warning and recorded as no evidence (`nodeclock.wait_trusted_clock`).
    clock = wait_trusted_clock(None, "init", clock_trusted, wait_clock_s)
    # A failed init takes back everything it made (probe r01: a store and a keystore left by a
    # failure made the home refuse `init` and crash `status`): what the home and an outside
    # software keystore directory held before is noted, and anything new removed on failure.
    made = Made.noting(home, ks_conf)
    if interrupted is not None:
        made.device_key = interrupted.device_key
    return home, made, (manifest, prof, ks_conf, clock)


def make_home(home: Path, made: "Made", manifest, prof: Profile, ks_conf: dict, clock: dict) -> bytes:
    """Make the home, the event key and the store; returns the public key. The caller opens the
    home, and on any failure (this, or the open) calls `made.undo()`."""
    home.mkdir(parents=True, exist_ok=True)
    os.chmod(home, 0o700)
    made.record()   # durable before anything else is made here
    site_id = os.urandom(16)
    if ks_conf.get("kind") == "software":
        ks_conf["dir"] = str(Path(ks_conf.get("dir") or home / "keystore").absolute())
    wrote_pin = "pin" in ks_conf
    ks_conf = keep_pin_out_of_store(home, ks_conf)
    try:
        ks = open_keystore(resolve_pin(ks_conf))
        kind = ks_conf.get("kind", "")
        try:
            public_key = ks.generate_key(EVENT_KEY, "ed25519", tag=made.generating(kind))
        except KeyExists:
            existing = ks.public_key(EVENT_KEY)
            if not made.reusable(kind, existing, ks.key_tag(EVENT_KEY)):
                made.nothing_generated()   # another's key: none of this init's is on the device
                raise
            log.warning("taking up the event key an unfinished init of %s made on the %s keystore",
                        home, ks_conf.get("kind"))
            public_key = existing
        except (DeviceTimeout, KeystoreUnavailable):
            raise      # the device may have made it: its record stays for the next init
        except KeystoreError:
            made.nothing_generated()   # refused by the device: nothing of this init is on it
            raise
        made.generated(ks_conf.get("kind", ""), public_key)
    except BaseException:
        if wrote_pin:  # a failed init leaves no PIN behind (it would outlive the attempt)
            Path(ks_conf["pin_file"]).unlink(missing_ok=True)
        raise
    # Paths inside the home are stored relative to it, so the home can move (docs/operations.md).
    for k in ("dir", "pin_file"):
        if k in ks_conf and Path(ks_conf[k]).parent == home:
            ks_conf[k] = Path(ks_conf[k]).name
    conn = db.connect(home / STORE_FILE)
    try:
        make_store(conn, home, site_id, public_key, manifest, prof, ks_conf, clock)
    finally:
        # Closed here, not left to the garbage collector: an open connection keeps the WAL (and every
        # page version in it) on the card after the node's own close.
        conn.close()
        ks.close() if hasattr(ks, "close") else None
    return public_key


def make_store(conn: sqlite3.Connection, home: Path, site_id: bytes, public_key: bytes, manifest,
               prof: Profile, ks_conf: dict, clock: dict) -> None:
    migrations.create(conn)
    with db.transaction(conn):
        db.set_meta(conn, "site_id", site_id)
        db.set_meta(conn, "mesh_id", manifest.mesh_id)
        db.set_meta(conn, "public_key", public_key)
        db.set_meta(conn, "authorities", json.dumps([a.hex() for a in manifest.authorities]))
        db.set_meta(conn, "profile", json.dumps(prof.as_dict()))
        db.set_meta(conn, "keystore", json.dumps(ks_conf))
        db.set_meta(conn, "machine", ident.machine_fingerprint())
        db.set_meta(conn, "clock_ceiling", 0)
        if clock["trusted"]:  # an unverified reading is no evidence (docs/apply.md)
            db.set_meta(conn, "clock_evidence", clock["now_ms"])
        db.set_meta(conn, "surfaced_limit", prof.surfaced_limit)
        db.set_meta(conn, "feed_retain", prof.feed_retain)
        db.set_meta(conn, "records_limit", prof.records_limit)
        db.set_meta(conn, "records_limit_bytes", prof.records_limit_bytes)
        sync_state.put_keyring(conn, site_id, public_key, None, "self", replace=False)
        for p in manifest.peers:
            if p.site_id == site_id:
                continue
            sync_state.put_keyring(conn, p.site_id, p.public_key, p.retired_after, "manifest")
        for t in manifest.tables:
            create_table_rows(conn, t)
    # The sync state and its default policy now, not at a first sync: a read verb on a full disk
    # (`policy list`, `record list`) must not be the one to create them.
    sync_state.ensure_schema(conn)
    write_identity_file(home, site_id, public_key, manifest.mesh_id, ks_conf)
    db.ensure_reserve(home)   # the space eviction may use on a full disk (agent/store/db.py)
    ident.claim_home(site_id, home)
    Made.done(home)


def open_parts(home: Path, check_machine: bool, read_only: bool):
    """The store and keystore a node runs on: (conn, keystore, bridge, log seal); keystore,
    bridge and seal are None for a read view. The caller builds the node on them and closes them
    if that fails. A read view writes nothing (no WAL set-up, no recovery, no journal
    compaction, no keystore), so it works on a full disk and beside a running agent; the journal
    is only inspected, and damage in it still refuses."""
    path = home / STORE_FILE
    if (home / INIT_MARKER).exists():
        raise NodeError(f"the init of {home} was cut short (killed, or the power went); run the same `init` again: "
                        "it removes what the first one made and completes")
    if not path.exists():
        raise NodeError(f"{home} holds no node; create one with `ssp-agent --home {home} init --manifest FILE`")
    conn = db.connect_readonly(path) if read_only else db.connect(path)
    try:
        # The layout version: a newer store is refused by both kinds of open;
        # a writing open migrates an older one forward (below, once the identity checks pass,
        # so a refused open changes nothing), a read view reads it as it is.
        migrations.refuse_newer(conn, path)
    except BaseException:
        conn.close()
        raise
    if check_machine:
        bound = db.get_meta(conn, "machine")
        here = ident.machine_fingerprint()
        if bound is not None and bound != here:
            site = bytes(db.get_meta(conn, "site_id")).hex()
            conn.close()
            raise NodeError(
                f"this home belongs to site {site}, created on another machine ({bound}, this is {here}). "
                "Running it here would make two devices sign as one site_id. Initialise a new node on this "
                "device, or, only if the original device is destroyed, run "
                f"`ssp-agent --home {home} identity rebind --confirm-original-destroyed`.")
    if read_only:
        try:
            journal_inspect(str(home / "sign-journal"))   # JournalCorrupt: refuse, as a writing open does
        except BaseException:
            conn.close()
            raise
        return conn, None, None, None
    if check_machine:
        site = bytes(db.get_meta(conn, "site_id"))
        other = ident.claim_home(site, home)
        if other is not None:
            conn.close()
            raise NodeError(
                f"this home is a copy of {other}, which holds the same node (site {site.hex()}): two homes "
                "signing as one site_id would reuse HLCs (§13.5). Initialise a new node here; or, if this copy "
                f"is to replace the original, remove {other} first (a home that moves is followed).")
    try:
        migrations.migrate(conn, path)
        db.ensure_bounds(conn)
    except BaseException:
        conn.close()
        raise
    db.ensure_reserve(home)   # a home made before it, or one whose reserve an eviction used
    ks_conf = home_paths(home, json.loads(db.get_meta(conn, "keystore")))
    ks = open_keystore(resolve_pin(ks_conf))
    try:
        # The event log, the held table and the journal's outputs are sealed at rest under the
        # store's data key, which only this keystore (or the one `keystore rewrap` moved the
        # data key to) unseals (docs/reliability.md "At rest").
        with seal_keystore(home, conn, ks) as sks:
            log_seal = atrest.open_log(conn, sks, bytes(db.get_meta(conn, "site_id")), home, now_ms())
        bridge = SigningBridge(ks, str(home / "sign-journal"), sealer=log_seal.sealer)
    except BaseException:
        ks.close()
        conn.close()
        raise
    return conn, ks, bridge, log_seal


def log_view(home: Path) -> tuple[sqlite3.Connection, atrest.LogSeal]:
    """A read-only connection to a home's store that can read the sealed log (`unseal` is
    installed; the keystore unseals the data keys and is closed again), and the LogSeal, whose
    sealer also opens the journal's sealed outputs. Writes nothing: for tools and tests that
    inspect a stopped node's files."""
    home = Path(home)
    conn = db.connect_readonly(home / STORE_FILE)
    try:
        conf = atrest.seal_keystore_conf(conn) or json.loads(db.get_meta(conn, "keystore"))
        ks = open_keystore(resolve_pin(home_paths(home, conf)))
        try:
            seal = atrest.open_log(conn, ks, bytes(db.get_meta(conn, "site_id")), home, 0, create=False)
        finally:
            ks.close()
        atrest.install(conn, seal)
    except BaseException:
        conn.close()
        raise
    return conn, seal


def create_table_rows(conn: sqlite3.Connection, t: TableDef) -> None:
    rowstore.insert_table_row(conn, t)
    rowstore.create_table(conn, t)


def check_retention(prof: Profile, tables) -> None:
    """A retention class the profile does not name is refused: a typo would silently keep that
    table's history forever (README "Device profiles")."""
    for t in tables:
        if t.retention is not None and prof.unknown_classes([t.retention]):
            known = sorted([*prof.horizons_ms, *prof.keep_full])
            raise NodeError(f"table {t.qualified}: retention class {t.retention!r} is not one profile {prof.name} "
                            f"names ({', '.join(known)}); fix the manifest, or add it to the profile's [horizons] "
                            f"(\"forever\" keeps it in full)")


def entries(d: Path | None) -> set[str] | None:
    """The names in directory ``d``; None when there is no such directory."""
    return set(os.listdir(d)) if d is not None and d.is_dir() else None


@dataclass
class Made:
    """What `init` may make, noted before it starts: the home (or its entries) and, for a software
    keystore, its directory (or its files). `undo` removes what was not there before."""

    home: Path
    home_before: set[str] | None          # None: the home was not there
    ks_dir: Path | None = None            # a software keystore's directory
    ks_before: set[str] | None = None
    # A key this init (or an unfinished one before it) generated on a token or the serial device,
    # {"kind", "public_key"}: a key cannot be taken back off a device, so the next init of this
    # home takes it up again instead of failing on KeyExists for ever
    device_key: dict | None = None

    @classmethod
    def noting(cls, home: Path, ks_conf: dict) -> "Made":
        ks_dir = None
        if ks_conf.get("kind") == "software":
            ks_dir = Path(ks_conf.get("dir") or home / "keystore").absolute()
        return cls(home, entries(home), ks_dir, entries(ks_dir))

    def record(self) -> None:
        """The marker (INIT_MARKER): this, durable, so a killed init can be undone later."""
        data = {"home_before": None if self.home_before is None else sorted(self.home_before),
                "ks_dir": None if self.ks_dir is None else str(self.ks_dir),
                "ks_before": None if self.ks_before is None else sorted(self.ks_before),
                "device_key": self.device_key}
        atomic_write(str(self.home / INIT_MARKER), json.dumps(data).encode(), 0o600)

    def generating(self, kind: str) -> bytes | None:
        """The event key is about to be asked of a device: the tag it will carry (where the device
        keeps one, ``Keystore.key_tag``) is recorded first, so a kill before the public key is
        recorded still leaves this init's key recognisable (firmware_bridge/keytag.py). A software
        key is a file ``undo`` removes: None."""
        if kind == "software":
            return None
        old = self.device_key
        if not keytag.valid(old) or old["kind"] != kind:
            record = keytag.new_record(kind, existed_before=False)
            # a record from before tags ({"kind", "public_key"}) keeps telling its key by that
            legacy = old.get("public_key") if isinstance(old, dict) and old.get("kind") == kind else None
            if legacy is not None and keytag.valid({**record, "public_key": legacy}):
                record["public_key"] = legacy
            self.device_key = record
            self.record()
        return keytag.tag_of(self.device_key)

    def nothing_generated(self) -> None:
        """The device refused to generate the key, or holds another's of that name: a record of
        this init's tag alone is dropped (``undo`` then removes the home as for any failure
        before a key was made)."""
        if self.device_key is not None and not self.device_key.get("public_key"):
            self.device_key = None

    def generated(self, kind: str, public_key: bytes) -> None:
        """The event key was just generated: a device's is recorded before anything else is made."""
        if kind != "software":     # a software key is a file `undo` removes
            self.device_key = {**(self.device_key or {}), "kind": kind, "public_key": public_key.hex()}
            self.record()

    def reusable(self, kind: str, public_key: bytes, tag: bytes | None = None) -> bool:
        """Whether the device's existing event key is the one an unfinished init of this home made:
        the public key it recorded, or the tag it recorded before asking for the key."""
        return keytag.is_ours(self.device_key, kind, public_key, tag)

    @staticmethod
    def done(home: Path) -> None:
        (home / INIT_MARKER).unlink()
        fsync_dir(str(home))

    @classmethod
    def interrupted(cls, home: Path) -> "Made | None":
        """The record of an init of ``home`` that never finished, or None."""
        try:
            data = json.loads((home / INIT_MARKER).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise NodeError(f"{home / INIT_MARKER} (left by an init cut short) cannot be read: {e}; "
                            "remove the home and run init again") from None
        hb, kd, kb, dk = (data.get(k) for k in ("home_before", "ks_dir", "ks_before", "device_key"))
        return cls(home, None if hb is None else set(hb), None if kd is None else Path(kd),
                   None if kb is None else set(kb), dk if isinstance(dk, dict) else None)

    def undo(self, keep_device_key: bool = True) -> None:
        """Remove what this init made; a key it made on a device stays there, and so does the
        record of it (the home then holds only the marker) for the next init to take it up."""
        try:
            if self.ks_dir is not None and self.ks_dir.parent != self.home:
                remove_new(self.ks_dir, self.ks_before)
            remove_new(self.home, self.home_before)
            if keep_device_key and self.device_key is not None:
                self.home.mkdir(parents=True, exist_ok=True)
                self.record()
        except OSError as e:   # the failure itself is what the operator must see
            log.warning("a failed init could not remove what it made in %s: %s", self.home, e)


def remove_new(path: Path, before: set[str] | None) -> None:
    """Remove the entries of `path` not in `before`; `path` itself if it was not there (None)."""
    if not path.exists():
        return
    if before is None:
        shutil.rmtree(path)
        return
    for name in set(os.listdir(path)) - before:
        p = path / name
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def check_keystore_conf(conf: dict) -> dict:
    """A keystore request that cannot be right is refused before anything is made (exit 2); a
    keystore that is right but unavailable is a fault the keystore reports (exit 1)."""
    from firmware_bridge.keystore import KeystoreConfigError, check_config
    try:
        conf = check_config(conf)
    except KeystoreConfigError as e:
        raise NodeError(str(e)) from None
    if conf.get("pin_file"):
        conf["pin_file"] = str(Path(conf["pin_file"]).absolute())
    return conf


def home_paths(home: Path, conf: dict) -> dict:
    """The keystore config with paths stored relative to the home resolved against it. (A home made
    before paths were stored this way by an `init` with a relative --home holds paths relative to
    the directory init ran in: those still resolve from there.)"""
    conf = dict(conf)
    for k in ("dir", "pin_file"):
        v = conf.get(k)
        if v and not os.path.isabs(v):
            in_home = home / v
            conf[k] = str(in_home if in_home.exists() or not os.path.exists(v) else Path(v).absolute())
    return conf


def keep_pin_out_of_store(home: Path, conf: dict) -> dict:
    """A token PIN given at init goes to HOME/keystore.pin (0600), never into the store, which
    gets copied and backed up; the store keeps only where to find it (`pin_file`), or the name
    of an environment variable (`pin_env`) when the operator gave one."""
    conf = dict(conf)
    if "pin" in conf:
        pin_path = home / "keystore.pin"
        fd = os.open(str(pin_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(str(conf.pop("pin")))
            f.flush()
            os.fsync(f.fileno())
        conf["pin_file"] = str(pin_path)
    return conf


@contextlib.contextmanager
def seal_keystore(home: Path, conn: sqlite3.Connection, ks):
    """The keystore whose seal key wraps the log's data keys: `ks` (the home's own), or the one
    `keystore rewrap` moved them to (meta atrest_keystore), opened for the duration and closed.
    One that cannot be opened is the at-rest fault: one line, what to do."""
    conf = atrest.seal_keystore_conf(conn)
    if conf is None:
        yield ks
        return
    try:
        other = open_keystore(resolve_pin(home_paths(home, conf)))
    except (KeystoreError, NodeError) as e:
        raise atrest.unavailable(home, conf.get("kind", "?"), f"is not available ({e})") from None
    try:
        yield other
    finally:
        other.close()


def resolve_pin(conf: dict) -> dict:
    """The keystore config with its PIN resolved (firmware_bridge.with_pin). A PIN that is not
    there is a keystore fault (exit 1, as a token that is not there): the environment or the file
    may be back on the next try, and the unit restarts on 1, never on a refusal's 2."""
    try:
        return with_pin(conf)
    except KeystoreUnavailable as e:
        todo = "set it in the environment of the command or the service (`systemctl edit ssp-agent`)" \
            if "pin_env" in conf and "pin_file" not in conf else "restore it or re-provision"
        raise KeystoreUnavailable(f"{e}; {todo}") from None


def write_identity_file(home: Path, site_id: bytes, public_key: bytes, mesh_id: bytes, ks: dict) -> None:
    """A human-readable card of who this node is (never secrets)."""
    data = {"site_id": site_id.hex(), "public_key": public_key.hex(), "mesh_id": mesh_id.hex(),
            "keystore": ks.get("kind")}
    (home / IDENTITY_FILE).write_text(json.dumps(data, indent=2) + "\n")

