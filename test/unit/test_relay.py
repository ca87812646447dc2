"""sglang_l3.testing.relay: forwards requests unchanged, streams answers chunk by
chunk, holds a request in its gate and sends it to the upstream current at release
(what test/agents/test_hermes_l3_restart.py relies on across a server restart)."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang_l3.testing.relay import Relay


@contextmanager
def upstream(name: str, release_second: threading.Event | None = None) -> Iterator[str]:
    """A server answering POST with `name`, the body and two streamed chunks (the
    second only after `release_second`); GET with `name`."""

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def do_GET(self) -> None:  # noqa: N802
            body = name.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            got = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(201)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk(b"data: " + name.encode() + b" " + got + b"\n\n")
            # a relay that buffered the answer would deliver the first event only now
            if release_second is not None and not release_second.wait(20):
                self._chunk(b"data: the first event was not relayed in time\n\n")
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as f:
        return f.status, f.read()


def test_forwards_and_streams_each_chunk_as_it_comes() -> None:
    second = threading.Event()
    seen: list[tuple[str, bytes]] = []
    with upstream("one", second) as base:
        relay = Relay(lambda: base, observe=lambda path, body, s: seen.append((path, body))).start()
        try:
            with urllib.request.urlopen(relay.base + "/v1/models", timeout=30) as f:
                assert f.read() == b"one"
            req = urllib.request.Request(relay.base + "/v1/chat/completions", data=b'{"x": 1}', method="POST")
            with urllib.request.urlopen(req, timeout=30) as f:
                assert f.status == 201 and f.headers["Content-Type"] == "text/event-stream"
                # the first event arrives while the upstream still holds the second
                assert f.readline() == b'data: one {"x": 1}\n'
                second.set()
                assert f.read() == b"\ndata: [DONE]\n\n"
        finally:
            relay.stop()
    assert seen == [("/v1/models", b""), ("/v1/chat/completions", b'{"x": 1}')]


def test_gate_holds_then_sends_to_the_upstream_current_at_release() -> None:
    release = threading.Event()
    arrived = threading.Event()

    def gate(path: str, body: bytes) -> None:
        if path.endswith("/hold"):
            arrived.set()
            release.wait(30)

    with upstream("old") as old, upstream("new") as new:
        current = {"base": old}
        relay = Relay(lambda: current["base"], gate=gate).start()
        out: dict[str, tuple[int, bytes]] = {}
        try:
            t = threading.Thread(target=lambda: out.setdefault("held", _post(relay.base + "/hold", b"b")))
            t.start()
            assert arrived.wait(30)
            assert _post(relay.base + "/free", b"a") == (201, b"data: old a\n\ndata: [DONE]\n\n")
            current["base"] = new  # the "restart"
            release.set()
            t.join(30)
        finally:
            release.set()
            relay.stop()
    assert out["held"] == (201, b"data: new b\n\ndata: [DONE]\n\n")


def test_a_client_that_leaves_a_silent_answer_closes_the_servers_connection() -> None:
    """A client that leaves while the server sends nothing yet (a restore in progress)
    is a disconnect the server sees at once, as without the relay (upstream aborts a
    disconnected request); before, the relay waited for the server's next chunk."""
    import socket

    answering = threading.Event()
    closed = threading.Event()

    class Silent(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            answering.set()
            # no byte of an answer: wait for the peer's close (recv returns b"")
            self.connection.settimeout(30)
            try:
                if self.connection.recv(1) == b"":
                    closed.set()
            except OSError:
                closed.set()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    relay = Relay(lambda: f"http://127.0.0.1:{httpd.server_address[1]}").start()
    try:
        host, port = relay.base.removeprefix("http://").split(":")
        client = socket.create_connection((host, int(port)), timeout=30)
        client.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
        assert answering.wait(30), "the request never reached the server"
        assert not closed.wait(0.5), "the server's connection closed before the client left"
        client.close()
        assert closed.wait(10), "the client left, the server's connection stayed open"
    finally:
        relay.stop()
        httpd.shutdown()
        httpd.server_close()
