"""The node's refusal, below every module that raises it (the node, producing, the CLI)."""
from __future__ import annotations


class NodeError(RuntimeError):
    """A refusal the operator must see (exit 2 in the CLI); the message says what to do."""
