"""Long coverage-guided fuzzing of one boundary with atheris (tools/fuzz.sh runs it).

    python3 tools/fuzz_atheris.py TARGET CORPUS_DIR [libFuzzer flags, e.g. -max_total_time=600]

TARGET is one of the targets of tests/hostile/targets.py (pure parsers) or `apply`, `records`,
`mailbox`, `session_meta` (through a real node on a temporary SQLite store) or `mqtt` (whole MQTT
messages through a real node's MQTT loop, both bindings). A target raising anything but its
designated refusal, or exceeding the per-input time or memory bound, is a finding: atheris stops
and writes the input as crash-*. The corpus is seeded from the tests (tools/fuzz.sh)."""
from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with atheris.instrument_imports(include=["agent", "firmware_bridge"]):
    import agent.core.codec  # noqa: F401 - instrumented for coverage
    from tests.hostile import targets as T


def main() -> None:
    name = sys.argv[1]
    if name in T.PURE:
        fn, memory = T.PURE[name], True
    elif name == "mqtt":
        fn, memory = T.FuzzRunner().message, False
    else:
        node = T.FuzzNode()
        fn, memory = {"apply": node.event_payload, "records": node.records, "mailbox": node.mailbox,
                      "session_meta": node.session_meta}[name], False

    def one(data: bytes) -> None:
        T.bounded(name, fn, data, memory=memory)

    atheris.Setup([sys.argv[0]] + sys.argv[2:], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
