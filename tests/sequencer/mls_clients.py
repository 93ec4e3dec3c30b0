"""Real MLS members for the sequencer tests, from the `rfc9420` package (1.3.0, test-only).

What it can and cannot do (design/ecosystem-notes.md): it frames Commits as PublicMessage only and
makes Add-only Commits without an UpdatePath; its handshake bytes are the PublicMessage without the
MLSMessage envelope, so ``mls_message`` prepends version mls10 and wire_format mls_public_message
(RFC 9420 §6). Two defects are worked around here, each where it is needed:
  - a member that loses a race is in state pending_commit and cannot process another Commit: it
    restores the snapshot it took before building its own (what a client does with a rejected
    Commit: drop it);
  - after processing another member's Commit, the committed proposal stays in its pending list, and
    the next Commit would add the same client twice: the stale list is cleared.
"""
from __future__ import annotations

import asyncio
import os

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from rfc9420 import DefaultCryptoProvider, GroupConfig, MemoryStorageProvider, MLSGroup
from rfc9420.interop.wire import decode_handshake, encode_handshake
from rfc9420.messages.data_structures import Credential, Signature
from rfc9420.messages.key_packages import KeyPackage, LeafNode

from agent.sequencer.framing import encode_vector

CRYPTO = DefaultCryptoProvider()
# Capabilities (RFC 9420 §7.2): versions [mls10], cipher_suites [0x0001], no extensions or
# proposals beyond the defaults, credentials [basic]
CAPABILITIES = (encode_vector(b"\x00\x01") + encode_vector(b"\x00\x01") + encode_vector(b"") + encode_vector(b"")
                + encode_vector(b"\x00\x01"))
MLS_PUBLIC_MESSAGE_HEAD = b"\x00\x01\x00\x01"   # version mls10, wire_format mls_public_message


def config() -> GroupConfig:
    return GroupConfig(crypto_provider=CRYPTO, storage_provider=MemoryStorageProvider())


def key_package(identity: bytes):
    """(KeyPackage, init private key, signature private key)."""
    enc, init, sig = X25519PrivateKey.generate(), X25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    sk, pk = sig.private_bytes_raw(), sig.public_key().public_bytes_raw()
    leaf = LeafNode(encryption_key=enc.public_key().public_bytes_raw(), signature_key=pk,
                    credential=Credential(identity=identity, public_key=pk), capabilities=CAPABILITIES,
                    lifetime_not_after=2**63)
    leaf = LeafNode(**{**leaf.__dict__,
                       "signature": Signature(CRYPTO.sign_with_label(sk, b"LeafNodeTBS", leaf.tbs_serialize()))})
    kp = KeyPackage(init_key=init.public_key().public_bytes_raw(), leaf_node=leaf)
    kp = KeyPackage(init_key=kp.init_key, leaf_node=leaf,
                    signature=Signature(CRYPTO.sign_with_label(sk, b"KeyPackageTBS", kp.tbs_serialize())))
    return kp, init.private_bytes_raw(), sk


def mls_message(plaintext) -> bytes:
    return MLS_PUBLIC_MESSAGE_HEAD + encode_handshake(plaintext)


class Member:
    def __init__(self, name: bytes, group: MLSGroup, sk: bytes) -> None:
        self.name, self.group, self.sk = name, group, sk
        self._snapshot: bytes | None = None
        self._staged = None
        self.proposal = None

    @classmethod
    def create(cls, name: bytes, group_id: bytes) -> "Member":
        kp, _init, sk = key_package(name)
        return cls(name, MLSGroup.create(config(), group_id, kp), sk)

    @property
    def epoch(self) -> int:
        return self.group.epoch

    def secret(self) -> bytes:
        return self.group.export_secret(b"sequencer-test", b"", 32)

    def build_add_commit(self, joiner: bytes) -> bytes:
        """Propose adding a fresh client and build a Commit for it in the current epoch (not merged)."""
        self._snapshot = self.group._inner.to_bytes()
        kp, _init, _sk = key_package(joiner + os.urandom(4))
        self.proposal = self.group.add(kp, self.sk)
        self.group.process_proposal(self.proposal, self.group.own_leaf_index)
        self._staged = self.group.create_commit(self.sk, return_per_joiner_welcomes=True)
        return mls_message(self._staged.commit_message)

    def accepted(self) -> list:
        """The sequencer accepted our Commit: merge it. Returns the Welcomes."""
        asyncio.run(self._staged.merge(self.group.config.storage_provider))
        self.group.apply_staged_commit(self._staged)
        welcomes, self._staged, self._snapshot = self._staged.welcomes, None, None
        return welcomes

    def rejected(self) -> None:
        """The sequencer said stale: drop our Commit (and its proposal) before processing the winner's."""
        if self._snapshot is not None:
            self.group = MLSGroup.from_bytes(self.group.config, self._snapshot)
        self._staged = self._snapshot = None

    def process(self, winner: "Member", commit: bytes) -> None:
        """Process the canonical Commit the sequencer forwarded (and the proposal it references)."""
        self.group.process_proposal(winner.proposal, winner.group.own_leaf_index)
        self.group.process_commit(decode_handshake(commit[len(MLS_PUBLIC_MESSAGE_HEAD):]))
        self.group._inner._pending_proposals = []      # rfc9420 1.3.0 keeps the committed proposal


def founding_group(group_id: bytes, names: list[bytes]) -> list[Member]:
    """The first member creates the group and adds the others in one Commit; they join by Welcome."""
    first = Member.create(names[0], group_id)
    kps = [key_package(n) for n in names[1:]]
    for kp, _init, _sk in kps:
        first.group.process_proposal(first.group.add(kp, first.sk), first.group.own_leaf_index)
    staged = first.group.create_commit(first.sk, return_per_joiner_welcomes=True)
    asyncio.run(staged.merge(first.group.config.storage_provider))
    first.group.apply_staged_commit(staged)
    members = [first]
    for (kp, init, sk), welcome, name in zip(kps, staged.welcomes, names[1:]):
        members.append(Member(name, MLSGroup.join_from_welcome(config(), welcome, init, key_package=kp), sk))
    return members
