"""What the sequencer answers: an accepted Commit's receipt, a rejection with the canonical head,
a stated absence (§22.6), and the two kinds of failure a verb raises (refused: CLI exit 2; a
local fault: CLI exit 1)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from agent.core.frozen import fast_init
from agent.sequencer import core


class SequencerRefused(Exception):
    """The request was refused (CLI exit 2)."""


class SequencerFault(Exception):
    """A local fault: state or keystore unusable (CLI exit 1)."""


class GroupLimit(SequencerRefused):
    """A new group beyond ``Sequencer.max_groups`` (reason ``group_limit``)."""

    reason = core.GROUP_LIMIT


class SequencerServing(SequencerRefused):
    """A `sequencer run` holds this home: requests go through the broker, reads are read-only."""


@fast_init
@dataclass(frozen=True)
class Accepted:
    group_id: bytes
    epoch: int
    receipt: bytes


@dataclass(frozen=True)
class Rejected:
    reason: str
    group_id: Optional[bytes]
    current_epoch: Optional[int]
    head: Optional[bytes]            # the exact bytes of the chain head's receipt, or None
    detail: str = ""


@dataclass(frozen=True)
class Absent:
    """§22.6: a stated absence, never a new signature."""
    discontinuity: bool
    statement: Optional[bytes] = field(default=None, compare=False)   # the signed statement, when there is one


Answer = Union[Accepted, Rejected]
