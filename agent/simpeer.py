"""Simulated peers for the demo, tests and benchmarks: a site with a raw Ed25519 key that
signs events exactly as a real producer does (docs/protocol.md §0 "Change events"), without a keystore.
Never used by a running node."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import nacl.signing

from .core import cose, events as ev
from .core.messages import SyncBody, emit_body


def readings_table(retention: str | None = None) -> str:
    """The sample sensor table of the demos, benchmarks and tests (one definition); with a
    retention class it is evictable (scope §3)."""
    ret = f'retention = "{retention}"\n' if retention else ""
    return ('\n[[tables]]\nschema = "app"\nname = "readings"\ncategory = "syncable"\n' + ret +
            'key = ["device", "seq"]\ncolumns = { device = "text", seq = "integer", temp = "real", note = "text" }\n')


NOTES_TABLE = '\n[[tables]]\nschema = "app"\nname = "notes"\ncategory = "syncable"\nkey = ["id"]\n' \
              'columns = { id = "text", body = "text" }\n'


def manifest_text(mesh_id: bytes, tables: str, peers: "list[SimPeer]" = ()) -> str:
    """A provisioning manifest (docs/cli.md "The manifest") for `tables`, trusting `peers`."""
    return f'mesh_id = "{mesh_id.hex()}"\n' + "".join(p.manifest_peer() for p in peers) + tables


@dataclass
class SimPeer:
    mesh_id: bytes
    site_id: bytes = field(default_factory=lambda: os.urandom(16))
    key: nacl.signing.SigningKey = field(default_factory=nacl.signing.SigningKey.generate)

    @property
    def public_key(self) -> bytes:
        return bytes(self.key.verify_key)

    def manifest_peer(self) -> str:
        return f'[[peers]]\nsite_id = "{self.site_id.hex()}"\npublic_key = "{self.public_key.hex()}"\n'

    def event(self, table: str, key: dict[str, Any], values: dict[str, Any] | None, hlc: tuple[int, int],
              delete: bool = False) -> bytes:
        schema, name = table.split(".", 1)
        pb = ev.payload_bytes(schema, name, key, "delete" if delete else "upsert", None if delete else values, hlc)
        return self.sign_payload(pb)

    def sign_payload(self, payload: bytes, kid: bytes | None = None, content_type: str = ev.EVENT_CONTENT_TYPE) -> bytes:
        """Sign arbitrary payload bytes (tests use this to build hostile but validly signed events)."""
        protected = cose.protected_header(cose.ALG_EDDSA, content_type, kid or self.site_id)
        sig = self.key.sign(cose.sig_structure(protected, self.mesh_id, payload)).signature
        return cose.assemble(protected, payload, sig)

    def body(self, events: list[bytes], records: list[bytes] | None = None,
             have_max: tuple[int, int] = (0, 0)) -> bytes:
        return emit_body(SyncBody(self.site_id, have_max, tuple(events), tuple(records or ()), ()))
