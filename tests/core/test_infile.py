"""agent/infile.py: what the CLI reads from files it is handed (helper 52's probe: a FIFO hung
`init --manifest` and `mailbox import` for ever, /dev/zero grew them to gigabytes, a Latin-1 byte
gave a traceback)."""
from __future__ import annotations

import os
import threading

import pytest

from agent import infile
from tests.waiting import HANG_S


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = threading.Event()
    err: list = []

    def read():
        try:
            infile.read_text(fifo, what="manifest")
        except infile.InputRefused as e:
            err.append(str(e))
        done.set()
    threading.Thread(target=read, daemon=True).start()
    assert done.wait(HANG_S), "read_text waited for a writer"
    assert err and "FIFO" in err[0], err


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/urandom", "DIR"])
def test_devices_and_directories_are_refused(tmp_path, path):
    with pytest.raises(infile.InputRefused, match="not a regular file"):
        infile.read_bytes(tmp_path if path == "DIR" else path, 1024)


def test_a_large_file_is_refused_on_its_size_and_one_at_the_limit_is_read(tmp_path):
    p = tmp_path / "f"
    with open(p, "wb") as f:
        f.truncate(200 * 1024 * 1024)       # sparse: 200 MB that cost nothing to write
    with pytest.raises(infile.InputRefused, match="too large"):
        infile.read_bytes(p, 1 << 20)
    p.write_bytes(b"x" * 1024)
    assert infile.read_bytes(p, 1024) == b"x" * 1024
    with pytest.raises(infile.InputRefused, match="too large"):
        infile.read_bytes(p, 1023)


def test_text_that_is_not_utf8_is_refused(tmp_path):
    p = tmp_path / "m.toml"
    p.write_bytes("# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(infile.InputRefused, match="not UTF-8"):
        infile.read_text(p)
    p.write_text("# caf\u00e9\n", encoding="utf-8")
    assert infile.read_text(p) == "# caf\u00e9\n"


def test_a_missing_file_is_the_callers_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        infile.read_bytes(tmp_path / "nope", 10)


def test_cut_returns_one_byte_past_the_limit_for_the_parser_to_refuse(tmp_path):
    p = tmp_path / "f"
    with open(p, "wb") as f:
        f.truncate(200 * 1024 * 1024)
    assert len(infile.read_bytes(p, 1024, cut=True)) == 1025
    with pytest.raises(infile.InputRefused, match="not a regular file"):
        infile.read_bytes("/dev/zero", 1024, cut=True)
