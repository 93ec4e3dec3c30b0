"""The control socket's framing (agent/control.py, agent/clientops.py): JSON lines, each bounded
by MAX_REQUEST; an oversize request is refused and what follows it drained, so the client reads the
refusal before the connection closes."""
from __future__ import annotations

import contextlib
import select
import socket

MAX_REQUEST = 1 << 20  # a command line or a batch of writes: a megabyte per request line


class LineReader:
    """Lines off a stream socket, each at most `limit` bytes (TooLarge past it); the last line may
    lack its newline (a CLI client shuts its side down after one request)."""

    def __init__(self, conn: socket.socket, limit: int) -> None:
        self.conn, self.limit, self.buf = conn, limit, b""

    def line(self) -> bytes | None:
        """The next line, None at end of stream."""
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line, self.buf = self.buf[:i], self.buf[i + 1:]
                if len(line) > self.limit:
                    raise TooLarge
                return line
            if len(self.buf) > self.limit:
                raise TooLarge
            b = self.conn.recv(65536)
            if not b:
                line, self.buf = self.buf, b""
                return line if line.strip() else None
            self.buf += b

    def pending(self) -> bool:
        return bool(self.buf.strip())

    def ready(self) -> tuple[list[bytes], bool]:
        """The whole lines received so far, reading only what the socket already holds (never
        waits), and whether the stream has ended."""
        ended = False
        if not self.buf.count(b"\n") and select.select([self.conn], [], [], 0)[0]:
            b = self.conn.recv(65536)
            ended = not b
            self.buf += b
        *lines, self.buf = self.buf.split(b"\n")
        if len(self.buf) > self.limit or any(len(x) > self.limit for x in lines):
            raise TooLarge
        return [x for x in lines if x.strip()], ended


def drain(conn: socket.socket, limit: int = 4 * MAX_REQUEST) -> None:
    """After refusing an oversize request: read (a bounded amount of) what the client is still
    sending, so closing does not reset the connection before it reads the error."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(2.0)
        n = 0
        while n < limit:
            b = conn.recv(65536)
            if not b:
                return
            n += len(b)


class TooLarge(ValueError):
    """A request line over MAX_REQUEST."""
