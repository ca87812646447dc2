"""A loopback HTTP relay between a client (Hermes) and the test server, so a test can
hold a client's request while it restarts the server behind it (the client sees one
slow answer, not a failed call), then forward it to the new server.

    relay = Relay(lambda: server.base, gate=hold).start()   # gate(path, body) may block
    box = Sandbox.create(..., base_url=relay.base + "/v1")
    ...
    relay.stop()

Every request is forwarded as it came (method, path, body, content type); the answer
is streamed back chunk by chunk (server-sent events stay live) and the connection
closed after it. Nothing is changed in either direction. A client that goes away
(closes its socket) closes the relay's connection to the server at once, even while
the server sends nothing (a restore in progress): the server sees the disconnect and
aborts the request as it would without the relay.
"""

from __future__ import annotations

import contextlib
import http.client
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# hop-by-hop headers, and the framing headers this relay replaces (it ends an answer
# by closing the connection)
_DROP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection"}


class Relay:
    def __init__(
        self,
        upstream: Callable[[], str],
        gate: Callable[[str, bytes], None] | None = None,
        timeout: float = 3600.0,
        observe: Callable[[str, bytes, float], None] | None = None,
    ) -> None:
        """`upstream()`: the current server's base URL, read per request (after the
        gate); `gate(path, body)`: called before forwarding, may block;
        `observe(path, body, first_chunk_s)`: called once the answer's first body
        chunk is relayed (seconds since the request went upstream: a streamed chat
        answer's time to first token, as the client sees it less the relay hop)."""
        self.upstream = upstream
        self.gate = gate
        self.observe = observe
        self.timeout = timeout
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base(self) -> str:
        if self._httpd is None:
            raise RuntimeError("relay not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Relay:
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection, ended by close

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (upstream's name)
                pass

            def _relay(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                if relay.gate is not None:
                    relay.gate(self.path, body)
                url = urllib.parse.urlsplit(relay.upstream())
                conn = http.client.HTTPConnection(url.hostname, url.port, timeout=relay.timeout)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _DROP}
                done, left = threading.Event(), threading.Event()
                threading.Thread(
                    target=_close_upstream_when_client_leaves, args=(self.connection, conn, done, left), daemon=True
                ).start()
                try:
                    t0 = time.perf_counter()
                    conn.request(self.command, self.path, body=body if n else None, headers=headers)
                    resp = conn.getresponse()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _DROP:
                            self.send_header(k, v)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    first = True
                    while chunk := resp.read1(65536):
                        if first and relay.observe is not None:
                            relay.observe(self.path, body, time.perf_counter() - t0)
                        first = False
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (OSError, http.client.HTTPException):
                    if not left.is_set():
                        raise  # not the client's leaving: report it
                finally:
                    done.set()
                    conn.close()

            do_GET = _relay  # noqa: N815 (BaseHTTPRequestHandler's names)
            do_POST = _relay  # noqa: N815

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


def _close_upstream_when_client_leaves(
    client: socket.socket, conn: http.client.HTTPConnection, done: threading.Event, left: threading.Event
) -> None:
    """Shut the server connection down once the client's socket reads end-of-file (it
    sent its one request already: anything readable now is its close) or fails."""
    gone = False
    while not done.is_set():
        if not gone:
            try:
                readable, _, _ = select.select([client], [], [], 0.2)
                if not readable:
                    continue
                gone = not client.recv(1, socket.MSG_PEEK)
            except (OSError, ValueError):
                gone = True  # reset or closed: the client is gone as well
            if not gone:
                done.wait(0.2)  # bytes after its request: not a close
                continue
        sock = conn.sock
        if sock is None:  # the server connection is not open yet
            done.wait(0.05)
            continue
        left.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        return
