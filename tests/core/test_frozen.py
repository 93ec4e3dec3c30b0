"""agent/core/frozen.py: the faster ``__init__`` builds what the dataclass's own would, and the
classes on the sequencer's hot path use it."""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Optional

import pytest

from agent.core.frozen import fast_init


def twins():
    """The same frozen dataclass twice: with the generated __init__ and with fast_init's."""
    def make():
        @dataclass(frozen=True)
        class Thing:
            a: bytes
            b: int
            c: Optional[str] = None
            d: tuple = field(default=())
            e: list = field(default_factory=list, compare=False)
            _fidict: str = "fields named like the generated code's own names"
            _fifactory_e: int = 0
            seen: list = field(default_factory=list, compare=False, repr=False)

            def __post_init__(self) -> None:
                if self.b < 0:
                    raise ValueError("b must be >= 0")
                self.seen.append("post")
        return Thing
    return make(), fast_init(make())


@pytest.mark.parametrize("args, kwargs", [
    ((b"x", 1), {}), ((b"x", 1, "c"), {}), ((b"x", 1, "c", (1, 2), [3]), {}),
    ((b"x",), {"b": 2, "d": (9,)}), ((), {"a": b"", "b": 0, "c": None, "e": [1]}),
])
def test_fast_init_builds_what_the_generated_init_builds(args, kwargs):
    slow, fast = twins()
    s, f = slow(*args, **kwargs), fast(*args, **kwargs)
    assert dataclasses.asdict(s) == dataclasses.asdict(f)
    assert repr(s).replace("make.<locals>.", "") == repr(f).replace("make.<locals>.", "")
    assert f.seen == ["post"]                               # __post_init__ ran, once
    assert f == fast(*args, **kwargs) and hash(f) == hash(fast(*args, **kwargs))
    assert f.e is not fast(*args, **kwargs).e or "e" in kwargs or len(args) > 4   # a fresh default each time
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.b = 5
    assert dataclasses.replace(f, b=7).b == 7


def test_fast_init_refuses_and_checks_as_the_generated_init_does():
    slow, fast = twins()
    assert list(inspect.signature(fast.__init__).parameters) == list(inspect.signature(slow.__init__).parameters)
    for cls in (slow, fast):
        with pytest.raises(TypeError):
            cls(b"x")                                       # b missing
        with pytest.raises(TypeError):
            cls(b"x", 1, z=3)                               # no such field
        with pytest.raises(ValueError):
            cls(b"x", -1)                                   # __post_init__'s check


def test_fast_init_is_only_for_frozen_dataclasses():
    @dataclass
    class Mutable:
        a: int

    @dataclass(frozen=True, slots=True)
    class Slotted:
        a: int
    @dataclass(frozen=True)
    class KeywordOnly:
        a: int
        b: int = field(default=0, kw_only=True)

    @dataclass(frozen=True)
    class WithInitVar:
        a: int
        scale: dataclasses.InitVar[int] = 1
    for cls in (Mutable, Slotted, int, KeywordOnly, WithInitVar):
        with pytest.raises(TypeError):
            fast_init(cls)


def test_the_group_commits_hot_classes_use_it():
    from agent.sequencer import core, framing, service
    for cls in (core.Head, core.GroupState, core.Accept, framing.Framing, service.Accepted):
        assert getattr(cls.__init__, "fast_init", False), cls
        assert cls.__dataclass_params__.frozen
