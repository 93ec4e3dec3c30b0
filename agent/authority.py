"""A standalone mesh authority (docs/operations.md §0): its own site_id and an Ed25519 key generated
inside a keystore, in a directory kept offline like a CA.

Records it issues are signed through the keystore bridge like every other signature in the agent
(persist-before-release, SOVM §22.5; docs/keystore.md): the directory holds the keystore, the
bridge's journal and a card naming them (authority.json), never a raw secret the agent reads. A
record released before a crash is in the journal; the next issuance stores it on the node first,
so the chain continues from it instead of forking. `authority.incomplete` exists only while
`create` runs or after one was cut short, so the same command completes the directory."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from firmware_bridge import EventIdentity, KeystoreError, OutcomeUnknown, SigningBridge, keytag, open_keystore
from firmware_bridge.fsutil import atomic_write, fsync_dir

FORMAT = "ssp-authority-v2"
OLD_FORMAT = "ssp-authority-key-v1"
KEY_NAME = "authority"
CARD = "authority.json"
MARKER = "authority.incomplete"   # a create in progress or cut short: the key it generates (keytag.py)
JOURNAL = "sign-journal"


class AuthorityError(Exception):
    """Something about an authority directory an operator must fix; the message says what."""


def create(directory: Path, keystore: dict | None = None) -> dict:
    """Make an authority directory: a new site_id and a key generated inside the keystore
    (software by default). Returns the card (no secrets)."""
    from .home import keep_pin_out_of_store, resolve_pin
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or (not _unfinished(directory) and any(directory.iterdir()))):
        raise AuthorityError(f"{directory} exists; an authority is never overwritten (choose a new, empty directory)")
    if not directory.parent.exists():
        raise AuthorityError(f"directory {directory.parent} does not exist")
    directory.mkdir(mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    conf = dict(keystore or {"kind": "software"})
    if conf.get("kind") == "software":
        conf.setdefault("dir", str(directory / "keystore"))
    conf = keep_pin_out_of_store(directory, conf)
    try:
        ks = open_keystore(resolve_pin(conf))
        try:
            public_key, _ = keytag.generate_or_take_up(ks, KEY_NAME, "ed25519", directory / MARKER,
                                                      conf.get("kind", ""), keytag.own_directory(conf, directory))
        finally:
            ks.close()
    except KeystoreError as e:
        raise AuthorityError(f"cannot create the authority key: {e}") from None
    # Paths inside the directory are kept relative, so the directory can move (an offline stick).
    for k in ("dir", "pin_file"):
        if k in conf and Path(conf[k]).parent == directory:
            conf[k] = Path(conf[k]).name
    card = {"format": FORMAT, "site_id": os.urandom(16).hex(), "public_key": public_key.hex(), "keystore": conf}
    atomic_write(str(directory / CARD), (json.dumps(card, indent=2) + "\n").encode(), 0o600)
    (directory / MARKER).unlink(missing_ok=True)
    fsync_dir(str(directory))
    return card


def _unfinished(directory: Path) -> bool:
    """Whether ``directory`` holds a `create` cut short: its key record and no card (a damaged
    record too: the create then starts a new one, keytag.generate_or_take_up)."""
    return (directory / MARKER).exists() and not (directory / CARD).exists()


class Authority:
    """An opened authority directory: sign records through its bridge, list what it released."""

    def __init__(self, directory: Path, *, fault_hook: Callable[[str], None] | None = None) -> None:
        """``fault_hook``: the bridge's test seam (named crash points); production passes none."""
        from .errors import NodeError
        from .home import resolve_pin
        self.directory = Path(directory)
        self.site_id, self.public_key, conf = _read_card(self.directory)
        conf = {k: str(self.directory / v) if k in ("dir", "pin_file") and not os.path.isabs(v) else v
                for k, v in conf.items()}
        try:
            self._ks = open_keystore(resolve_pin(conf))
        except (KeystoreError, NodeError) as e:
            raise AuthorityError(f"{self.directory}: cannot open the authority's keystore: {e}") from None
        try:
            if self._ks.public_key(KEY_NAME) != self.public_key:
                raise AuthorityError(f"{self.directory}: the keystore's key is not the one in {CARD} "
                                     "(wrong token or device)")
            self.bridge = SigningBridge(self._ks, str(self.directory / JOURNAL), fault_hook=fault_hook)
        except KeystoreError as e:
            self._ks.close()
            raise AuthorityError(f"{self.directory}: {e}") from None
        except BaseException:
            self._ks.close()
            raise

    def released(self) -> list[bytes]:
        """Every record this authority ever released, exact bytes, in release order."""
        return [raw for _identity, raw in self.bridge.iter_released()]

    def sign(self, tbs: bytes, assemble: Callable[[bytes], bytes], now_ms: int) -> bytes:
        """Release one record: a fresh identity above every one ever intended here (the journal
        is the durable clock), signed and persisted before it is returned."""
        for _attempt in range(8):
            hi = self.bridge.max_event_hlc(self.site_id)
            hlc = (now_ms, 0) if hi is None or now_ms > hi[0] else (hi[0], hi[1] + 1)
            try:
                return self.bridge.release(EventIdentity(self.site_id, *hlc), KEY_NAME, tbs, assemble)
            except OutcomeUnknown:
                continue  # spent by a crash: the next identity is above it
        raise AuthorityError(f"{self.directory}: the journal keeps reporting unknown outcomes; check the keystore")

    def close(self) -> None:
        self.bridge.close()
        self._ks.close()

    def __enter__(self) -> "Authority":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_card(directory: Path) -> tuple[bytes, bytes, dict]:
    if directory.is_file():
        try:
            old = json.loads(directory.read_text()).get("kind") == OLD_FORMAT
        except (OSError, ValueError, AttributeError):
            old = False
        if old:
            raise AuthorityError(f"{directory} is an old authority key file holding a raw secret; records are now "
                                 "signed only through a keystore. Create an authority directory with "
                                 "`ssp-agent authority create --out DIR`, list it on every node "
                                 "(`ssp-agent authority add`), and retire the old file.")
        raise AuthorityError(f"{directory} is a file; --authority-key names the directory made by `authority create`")
    try:
        card = json.loads((directory / CARD).read_text())
        if card.get("format") != FORMAT:
            raise ValueError(f"format {card.get('format')!r}")
        site, pk, conf = bytes.fromhex(card["site_id"]), bytes.fromhex(card["public_key"]), card["keystore"]
        if len(site) != 16 or len(pk) != 32 or not isinstance(conf, dict):
            raise ValueError("bad lengths")
    except FileNotFoundError:
        if (directory / MARKER).exists():
            raise AuthorityError(f"{directory} holds no {CARD}: its `authority create` was cut short; run the "
                                 "same `authority create` again to complete it") from None
        raise AuthorityError(f"{directory} holds no {CARD}: not an authority directory (make one with "
                             "`ssp-agent authority create --out DIR`)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise AuthorityError(f"{directory / CARD}: not a usable authority card ({e})") from None
    return site, pk, conf
