"""MLS members from two more implementations for the sequencer tests, both test-only:

- mls-rs, through its UniFFI Python bindings (PyPI `agentvault-mls-rs-uniffi`): Commits carry an
  UpdatePath (`Group.commit()`), framed as PublicMessage;
- ts-mls (npm, pinned in `ts_mls/package.json`, installed by tools/setup.sh), run by Node in one
  process per test (`ts_mls/member.mjs`): Commits carry an UpdatePath and are PrivateMessage.

Every member has the same five operations the race needs: `commit()` builds a Commit for the current
epoch without merging it, `accepted()` merges it when the sequencer accepted it, `rejected()` drops it,
`process(commit)` takes the canonical Commit the sequencer published, and `secret()` is the epoch's
exporter secret (RFC 9420 §8.5), equal across members, implementations included, iff their group
states agree."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

rs = None   # mls_rs_uniffi, imported by the first RsMember
TS_DIR = Path(__file__).resolve().parent / "ts_mls"
LABEL = b"sequencer-test"


class RsMember:
    def __init__(self, name: str) -> None:
        global rs
        # published for x86-64 only: elsewhere (a Pi running the suite) the mls-rs cases are skipped
        rs = pytest.importorskip("mls_rs_uniffi", reason="mls-rs's Python bindings have no wheel for this machine")
        self.name = name
        suite = rs.CipherSuite.CURVE25519_AES128   # MLS_128_DHKEMX25519_AES128GCM_SHA256_Ed25519 (0x0001)
        default = rs.client_config_default()
        # the Welcome carries the ratchet tree, so members of any implementation join from it alone
        config = rs.ClientConfig(group_state_storage=default.group_state_storage, use_ratchet_tree_extension=True)
        self.client = rs.Client(name.encode(), rs.generate_signature_keypair(suite), config)
        self.group = None
        self._pending: bytes | None = None

    def key_package(self) -> bytes:
        return self.client.generate_key_package_message().to_bytes()

    def create(self, gid: bytes) -> None:
        self.group = self.client.create_group(gid)

    def add(self, key_packages: list[bytes]) -> tuple[bytes, bytes]:
        """The founding Commit, merged at once: (commit, welcome)."""
        out = self.group.add_members([rs.Message.from_bytes(k) for k in key_packages])
        self.group.process_incoming_message(out.commit_message)   # mls-rs applies its own pending Commit
        return out.commit_message.to_bytes(), out.welcome_message.to_bytes()

    def join(self, welcome: bytes) -> None:
        self.group = self.client.join_group(None, rs.Message.from_bytes(welcome)).group

    def commit(self) -> bytes:
        self._pending = self.group.commit().commit_message.to_bytes()
        return self._pending

    def accepted(self) -> None:
        self.group.process_incoming_message(rs.Message.from_bytes(self._pending))
        self._pending = None

    def rejected(self) -> None:
        # mls-rs replaces a pending Commit when it processes another member's for the same epoch
        self._pending = None

    def process(self, commit: bytes) -> None:
        got = self.group.process_incoming_message(rs.Message.from_bytes(commit))
        assert got.is_commit(), got

    def secret(self) -> bytes:
        return self.group.export_secret(LABEL, b"", 32)


class TsHost:
    """One Node process holding every ts-mls member of a test."""

    def __init__(self) -> None:
        node = shutil.which("node")
        if node is None or not (TS_DIR / "node_modules" / "ts-mls").is_dir():
            raise RuntimeError("ts-mls is not installed: run tools/setup.sh (Node 20+ and `npm ci` in "
                               f"{TS_DIR})")
        self.proc = subprocess.Popen([node, str(TS_DIR / "member.mjs")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=TS_DIR)

    def call(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"ts-mls host exited ({self.proc.poll()})")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise RuntimeError(f"ts-mls {req['op']} failed: {answer['error']}")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class TsMember:
    def __init__(self, host: TsHost, name: str) -> None:
        self.host, self.name = host, name

    def _call(self, op: str, **kw) -> dict:
        return self.host.call(op=op, name=self.name, **kw)

    def key_package(self) -> bytes:
        return bytes.fromhex(self._call("key_package")["kp"])

    def create(self, gid: bytes) -> None:
        self._call("create", gid=gid.hex())

    def add(self, key_packages: list[bytes]) -> tuple[bytes, bytes]:
        r = self._call("add", kps=[k.hex() for k in key_packages])
        return bytes.fromhex(r["commit"]), bytes.fromhex(r["welcome"])

    def join(self, welcome: bytes) -> None:
        self._call("join", welcome=welcome.hex())

    def commit(self) -> bytes:
        return bytes.fromhex(self._call("commit")["commit"])

    def accepted(self) -> None:
        self._call("accepted")

    def rejected(self) -> None:
        self._call("rejected")

    def process(self, commit: bytes) -> None:
        self._call("process", msg=commit.hex())

    def secret(self) -> bytes:
        return bytes.fromhex(self._call("status")["secret"])


def found(gid: bytes, members: list) -> None:
    """The first member creates the group and adds the others in one Commit; they join by Welcome."""
    kps = [m.key_package() for m in members[1:]]
    members[0].create(gid)
    _commit, welcome = members[0].add(kps)
    for m in members[1:]:
        m.join(welcome)
