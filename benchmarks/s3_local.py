"""A real S3-compatible server (moto_server) on loopback, for the tests and benchmarks that
talk to S3 the way they would to AWS or MinIO: boto3 over real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import time

from benchmarks.common import Unavailable, free_port


class MotoServer:
    """A real S3-compatible server (moto_server) on a free loopback port; url is its endpoint."""

    def __init__(self, require_auth: bool = False):
        import shutil

        if shutil.which("moto_server") is None:
            raise Unavailable("moto_server not installed (pip install 'moto[server]')")
        env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if require_auth else {})}
        # free_port() only says the port was free a moment ago: another process (a job's
        # rendezvous store) can take it first, moto_server then exits, and the port answers for
        # that process until it goes. So: ready when it accepts connections *and* our server
        # still runs; else a new port (seen once in a loaded CI run: 11 S3 tests refused).
        for _ in range(3):
            if self._start(env):
                return
        raise RuntimeError("moto_server did not start")

    def _start(self, env: dict) -> bool:
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["moto_server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            except OSError:
                time.sleep(0.05)
                continue
            time.sleep(0.2)  # a server that lost the port exits at once, having printed why
            if self.proc.poll() is None:
                return True
        self.stop()
        return False

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
