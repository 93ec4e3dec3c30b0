"""A faster ``__init__`` for frozen dataclasses built on a hot path (the sequencer's group commit
builds five of them a Commit: docs/performance.md).

A frozen dataclass's generated ``__init__`` sets each field with ``object.__setattr__`` (its own
``__setattr__`` refuses): ~0.1 µs a field, 0.8 µs for a seven-field group state. ``fast_init``
replaces it with one of the same signature and defaults that stores the fields straight into the
instance's ``__dict__`` (~0.3 µs), then calls ``__post_init__`` where the class has one. Nothing else
changes: the instances are the same dataclass, still frozen, equal, hashed and printed alike
(tests/core/test_frozen.py compares them with the generated ``__init__``'s).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar, cast

T = TypeVar("T")


def fast_init(cls: type[T]) -> type[T]:
    """Decorate a ``@dataclass(frozen=True)`` class (applied above it); see the module."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or hasattr(cls, "__slots__"):
        raise TypeError(f"fast_init is for frozen dataclasses with an instance __dict__, not {cls.__name__}")
    fields = dataclasses.fields(cast(Any, cls))  # a dataclass: `__dataclass_params__` says so
    generated = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if [p.name for p in generated] != [f.name for f in fields] or \
            any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in generated):
        # InitVar or keyword-only fields: the generated __init__ is not the plain one built here
        raise TypeError(f"fast_init: {cls.__name__}'s __init__ takes more than its fields, in order")
    names = {f.name for f in fields} | {"self"}
    # the generated code's own names all start with a prefix no field name starts with
    prefix = "_fi"
    while any(n.startswith(prefix) for n in names):
        prefix += "_"
    store, missing = prefix + "dict", prefix + "missing"
    namespace: dict[str, Any] = {missing: dataclasses.MISSING}
    args, body = [], [f"    {store} = self.__dict__"]
    for f in fields:
        if not f.init:
            raise TypeError(f"fast_init: {cls.__name__}.{f.name} is not an __init__ field")
        if f.default is not dataclasses.MISSING:
            namespace[f"{prefix}default_{f.name}"] = f.default
            args.append(f"{f.name}={prefix}default_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"{prefix}factory_{f.name}"] = f.default_factory
            args.append(f"{f.name}={missing}")
            body.append(f"    if {f.name} is {missing}:\n        {f.name} = {prefix}factory_{f.name}()")
        else:
            args.append(f.name)
        body.append(f"    {store}[{f.name!r}] = {f.name}")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    exec(f"def __init__(self, {', '.join(args)}) -> None:\n" + "\n".join(body) + "\n", namespace)  # noqa: S102
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    init.fast_init = True
    cls.__init__ = init  # type: ignore[method-assign]  # replacing the generated __init__ is the point
    return cls
