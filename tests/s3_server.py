"""Test helpers for S3: a real moto_server on loopback, and a TCP proxy that can cut the line.

moto_server is an S3-compatible HTTP server; the code under test talks to it with
boto3 over real sockets, exactly as it would to AWS or MinIO. The proxy sits
between them so a test can make the network fail in the middle of an upload.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time

import pytest

from conftest import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class MotoServer:
    def __init__(self, require_auth: bool = False):
        if shutil.which("moto_server") is None:
            pytest.skip("moto_server not installed (pip install 'moto[server]')")
        self.port = free_port()
        env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if require_auth else {})}
        self.proc = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto_server did not start")

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


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
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
            except OSError:
                pass

    def restore(self) -> None:
        self.cut_after, self.is_cut = None, False
        self._listen()
