"""agent/sqlbind.py: blobs, NULLs and booleans bound through their identity adapters are bound
exactly as the sqlite3 module bound them without (the same stored values and types), and both
stores register them when imported."""
import sqlite3
import subprocess
import sys

from agent.sqlbind import bind_plainly

VALUES = [b"", b"\x00blob\xff" * 40, None, True, False, 7, -1, 2**63 - 1, 1.5, "text", bytearray(b"ba")]


class Sub(bytes):
    pass


def _stored(values):
    c = sqlite3.connect(":memory:")
    c.execute("CREATE TABLE t (v)")
    c.executemany("INSERT INTO t VALUES (?)", [(v,) for v in values])
    c.execute("INSERT INTO t VALUES (?), (?)", (b"multi", None))   # the multi-row form too
    return c.execute("SELECT v, typeof(v) FROM t ORDER BY rowid").fetchall()


def test_the_identity_adapters_store_what_the_module_stored():
    keys = [(t, sqlite3.PrepareProtocol) for t in (bytes, bool, type(None))]
    saved = {k: sqlite3.adapters.pop(k) for k in keys if k in sqlite3.adapters}
    try:
        before = _stored(VALUES + [Sub(b"sub")])
        bind_plainly()
        bind_plainly()                  # idempotent
        assert all(k in sqlite3.adapters for k in keys)
        after = _stored(VALUES + [Sub(b"sub")])
    finally:
        for k in keys:
            sqlite3.adapters.pop(k, None)
        sqlite3.adapters.update(saved)
        bind_plainly()
    assert after == before
    assert [t for _v, t in after[:5]] == ["blob", "blob", "null", "integer", "integer"]
    assert after[3][0] == 1 and after[4][0] == 0


def test_both_stores_register_them_on_import():
    for module in ("agent.store.db", "agent.sequencer.store"):
        code = (f"import sqlite3, {module}; "
                "print(all((t, sqlite3.PrepareProtocol) in sqlite3.adapters for t in (bytes, bool, type(None))))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip() == "True", module
