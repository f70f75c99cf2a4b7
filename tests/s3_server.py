"""Test helpers for S3: proxies in front of the real moto_server that cut or throttle the line.

moto_server is an S3-compatible HTTP server (benchmarks/s3_local.py's MotoServer starts it; the
conftest's s3 fixture shares one per session); the code under test talks to it with boto3 over
real sockets, exactly as it would to AWS or MinIO. The proxies sit between them so a test can make
the network fail in the middle of an upload, or the endpoint answer 503 for a while.
"""

from __future__ import annotations

import socket
import threading

from benchmarks.common import free_port
from benchmarks.s3_local import MotoServer  # noqa: F401 - tests import it from here

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class CuttableProxy:
    """Forwards 127.0.0.1:port to a target port; after `cut_after` client bytes it drops every
    connection and refuses new ones until restore()."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self.sent = 0  # bytes forwarded client -> server
        self.cut_after: int | None = None
        self.is_cut = False
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listen()

    def _listen(self) -> None:
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", self.port))
        self._server.listen(16)
        threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counts: bool) -> None:
        try:
            while data := src.recv(65536):
                if counts:
                    with self._lock:
                        self.sent += len(data)
                        over = self.cut_after is not None and self.sent > self.cut_after
                    if over:
                        self.cut()
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        """The network dies: every open connection is reset and new ones are refused."""
        self.is_cut = True
        self._server.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                s.close()
            except OSError:
                pass

    def restore(self) -> None:
        self.cut_after, self.is_cut = None, False
        self._listen()


class FlakyS3Proxy:
    """An HTTP proxy in front of moto_server that answers 503 SlowDown (S3's "reduce your request
    rate") to the first `failures` PUTs whose path contains `fail_puts_matching`, and forwards
    everything else: an S3 endpoint that throttles for a while, as AWS does under load."""

    def __init__(self, target_port: int, fail_puts_matching: str, failures: int):
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self
        self.failed, self.failures, self.needle = 0, failures, fail_puts_matching
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                        if size == 0:
                            return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _handle(self) -> None:
                body = self._body()
                with proxy._lock:
                    throttle = (
                        self.command == "PUT"
                        and proxy.needle in self.path
                        and proxy.failed < proxy.failures
                    )
                    proxy.failed += throttle
                if throttle:
                    reply = (
                        b"<Error><Code>SlowDown</Code>"
                        b"<Message>Please reduce your request rate.</Message></Error>"
                    )
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", target_port, timeout=60)
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("transfer-encoding", "connection")
                }
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                self.send_response(response.status)
                head = self.command == "HEAD"  # no body, but the real object's length
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection") and (
                        head or key.lower() != "content-length"
                    ):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
