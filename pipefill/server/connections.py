"""The server's HTTP/1.1 connections, guarded against clients that hold them open: uvicorn's h11
protocol plus a deadline on every request's headers and a cap on open connections.

uvicorn (0.55) arms no timer on a connection until its first response, and its keep-alive timer
is cancelled by every byte that arrives, so a client that sends its headers a byte at a time, or
nothing at all, keeps its connection (and h11's buffer of up to 16 KiB) for as long as it likes.
Request bodies have their own deadline in the app (--body-read-timeout), which answers a 408."""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("pipefill.server")

CONNECTION_RETRY_AFTER_S = 1


def guarded_protocol(header_read_timeout: float, max_connections: int) -> type:
    """The protocol class to give uvicorn.Config(http=...), with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_read_timeout": header_read_timeout,
                 "max_connections": max_connections})


class GuardedH11Protocol(H11Protocol):
    """h11 with a header deadline (from the connection's start, or from the end of its previous
    response, to the end of the next request's headers) and a connection cap: a connection
    opened while max_connections others are open has its request answered with a 503 and a
    sentence, then closed."""
    header_read_timeout: float = 10.0
    max_connections: int = 512

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.app = self._too_many_connections  # this connection only
        self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete: its cycle has begun
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        # Armed before uvicorn looks at pipelined data: a request already buffered starts a
        # cycle in there and disarms it again. Bytes of a body the app did not read (a 401 or
        # 413 answered early) are dropped by h11 and do not disarm it.
        self._arm_header_deadline()
        super().on_response_complete()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_read_timeout,
                                                     self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing():
            return
        log.debug("closing a connection from %s: no complete request headers within "
                  "--header-read-timeout %s s", self.client, self.header_read_timeout)
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass  # h11 already counts the connection as broken
        self.transport.close()

    async def _too_many_connections(self, scope, receive, send) -> None:
        message = (f"the server has {self.max_connections} connections open, its limit "
                   f"(--max-connections); retry after {CONNECTION_RETRY_AFTER_S} s or reuse an "
                   "open connection")
        body = json.dumps({"error": {"message": message, "type": "server_error",
                                     "param": None, "code": 503}}).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(CONNECTION_RETRY_AFTER_S).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
