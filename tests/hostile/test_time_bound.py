"""The fuzz targets' time bound counts the CPU an input costs, not the wall clock: a machine
busy with other work (or a Pi) stretches the wall time of any input, and a superlinear parse is
CPU spent. A target that waits (an fsync, a lock, a descheduled process) is not a finding; one
that burns CPU beyond the bound is."""
from __future__ import annotations

import time

import pytest

from . import targets as T


def test_an_input_that_waits_is_no_finding():
    assert T.bounded("waits", lambda d: time.sleep(T.TIME_BOUND_S + 0.5) or d, b"x") == b"x"


def test_an_input_that_burns_cpu_beyond_the_bound_is_a_finding():
    def burn(d: bytes) -> bytes:
        end = time.process_time() + T.TIME_BOUND_S + 0.2
        while time.process_time() < end:
            pass
        return d
    with pytest.raises(T.Finding, match="burns"):
        T.bounded("burns", burn, b"x")
