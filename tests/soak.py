"""How much of a long randomized trial a run takes: a sample in the suite (`tools/test.sh`, CI),
the whole trial under `tools/soak.sh` (SSP_SOAK=1), whose last result docs/testing.md "Soaks"
records. The sample checks the same properties on fewer draws; the soak finds the rare ones."""
from __future__ import annotations

import os

SOAK = os.environ.get("SSP_SOAK") == "1"


def sample(suite: int, soak: int) -> int:
    """`soak` draws under tools/soak.sh, `suite` otherwise."""
    return soak if SOAK else suite
