"""The catch-and-classify guard every boundary parser wears (docs/protocol.md §11 "Boundaries and limits").

A boundary parser turns bytes from outside (a sync body, a handshake, a presence payload, the
frame meta, a mailbox file, an event, a control record, a session frame) into a value or refuses
them with its one designated error, whose `reason` is a stable code. The parsers are written to
refuse every malformed input by name; this guard is the net under them: anything else a parser
raises on hostile bytes (TypeError, RecursionError, OverflowError, MemoryError: a bug the fuzzers
in tests/hostile would report) becomes the designated error with reason `unclassified`, so a
message can never crash the loop that received it, nor crash it again when redelivered.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])

UNCLASSIFIED = "unclassified"


def classified(refusal: Callable[[str, str], BaseException], *designated: type[BaseException]) -> Callable[[F], F]:
    """Decorate a boundary parser: it returns its value or raises one of `designated` (by
    default the type `refusal` builds); any other Exception becomes `refusal(UNCLASSIFIED, what)`."""
    # without `designated`, `refusal` is the exception class itself
    kinds: tuple[type[BaseException], ...] = designated or (cast("type[BaseException]", refusal),)

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(*args: Any, **kw: Any) -> Any:
            try:
                return fn(*args, **kw)
            except kinds:
                raise
            except Exception as e:  # noqa: BLE001 - the point of the guard
                raise refusal(UNCLASSIFIED, f"{fn.__name__}: {type(e).__name__}") from None
        return guarded  # type: ignore[return-value]
    return deco
