"""What `mailbox import` prints and holds does not grow with the events that did not simply apply
(helper 52's probe: 50 000 copies of one valid event in one file, imported again, took the import
to 92 MB and printed 11.7 MB, one detail object per event, all of them kept to the end). Now the
detail lists at most mailbox_sync.MAILBOX_DETAIL_MAX of them, in order; the counts cover every event and
`events_not_listed` says how many more there were (docs/cli.md `mailbox import`: the counts, plus detail)."""
from __future__ import annotations

from agent import mailbox_sync
from agent.sync import export_mailbox_body, import_mailbox_body

from ..mqtt.helpers import make_nodes, write


def test_the_detail_of_an_import_is_bounded_and_the_counts_are_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(mailbox_sync, "MAILBOX_DETAIL_MAX", 100, raising=False)
    a, b = nodes = make_nodes(tmp_path, 2)
    try:
        for i in range(300):
            write(a, i)
        f = tmp_path / "ab.cbor"
        assert export_mailbox_body(a, b.site_id, f)["events"] == 300
        first = import_mailbox_body(b, f.read_bytes())
        assert first["applied"] == 300 and first["events"] == [] and first.get("events_not_listed", 0) == 0
        again = import_mailbox_body(b, f.read_bytes())
        assert again["duplicate"] == 300
        assert len(again["events"]) == 100 and again["events_not_listed"] == 200
    finally:
        for n in nodes:
            n.close()
