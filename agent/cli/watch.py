"""`ssp-agent watch`: the change feed as JSON lines, for shell scripts (docs/client.md "The change
feed"). Through the running agent's socket when `run` holds the home, else read from the store;
never a writer, so it works beside either."""
from __future__ import annotations

import json
import sys

from .args import count_arg, seconds_arg
from .common import EXIT_FAULT, EXIT_OK, Refused


def cmd_watch(args) -> int:
    from ..client import Client, ClientError, CursorExpired, FellBehind
    c = Client(args.home)
    try:
        for rec in c.watch(args.table or None, args.since, idle_s=args.idle, raw=True):
            sys.stdout.write(json.dumps(rec, separators=(",", ":")) + "\n")
            sys.stdout.flush()
    except CursorExpired as e:
        raise Refused(f"{e} (cursor {e.cursor}; the oldest kept follows {e.oldest}; head {e.head})") from None
    except FellBehind as e:
        print(f"ssp-agent: {e}; resume with --since {e.cursor}", file=sys.stderr)
        return EXIT_FAULT
    except ClientError as e:
        raise Refused(str(e)) from None
    except (BrokenPipeError, KeyboardInterrupt):
        return EXIT_OK
    finally:
        c.close()
    return EXIT_OK


def register(sub, mailbox_sub) -> None:
    s = sub.add_parser("watch", help="follow the change feed: one JSON line per change to a row or per event "
                                     "dropped, rejected or held")
    s.add_argument("--table", action="append", metavar="SCHEMA.TABLE",
                   help="only this table's records (repeatable; default: every table)")
    s.add_argument("--since", type=count_arg, metavar="CURSOR",
                   help="records after this cursor (0: everything retained; default: from now)")
    s.add_argument("--idle", type=seconds_arg, metavar="SECONDS",
                   help="exit 0 after SECONDS without a record (default: follow until interrupted)")
    s.set_defaults(fn=cmd_watch)
