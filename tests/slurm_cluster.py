"""A real one-node SLURM cluster for the tests: munged, slurmctld and slurmd on this host, in a temp
dir.

Needs root and Debian's slurm-wlm and munge packages (.ci/run installs them where it can);
anything missing is a clean skip. The daemons use their own ports, state and munge socket, so
nothing of the machine's own SLURM setup (if any) is touched.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from benchmarks.common import free_port


class SlurmCluster:
    def __init__(self):
        missing = [
            b for b in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(b) is None
        ]
        if missing:
            pytest.skip(
                f"SLURM not installed ({', '.join(missing)}): apt-get install slurm-wlm munge"
            )
        if os.geteuid() != 0:
            pytest.skip("a test SLURM cluster needs root (its daemons run as root here)")
        self.dir = tempfile.mkdtemp(prefix="slurm-")
        host = socket.gethostname()
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(self.dir, sub))
        self.conf = os.path.join(self.dir, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(
                "\n".join(
                    [
                        "ClusterName=test",
                        f"SlurmctldHost={host}(127.0.0.1)",
                        f"SlurmctldPort={free_port()}",
                        f"SlurmdPort={free_port()}",
                        "SlurmUser=root",
                        "SlurmdUser=root",
                        "AuthType=auth/munge",
                        "CredType=cred/munge",
                        f"AuthInfo=socket={self.dir}/munge.sock,cred_expire=5",
                        f"StateSaveLocation={self.dir}/state",
                        f"SlurmdSpoolDir={self.dir}/spool",
                        f"SlurmctldPidFile={self.dir}/slurmctld.pid",
                        f"SlurmdPidFile={self.dir}/slurmd.pid",
                        "ProctrackType=proctrack/linuxproc",
                        "TaskPlugin=task/none",  # no cgroups needed
                        "SelectType=select/cons_tres",
                        "SelectTypeParameters=CR_CPU",
                        "ReturnToService=2",
                        "MpiDefault=none",
                        "JobAcctGatherType=jobacct_gather/none",
                        "AccountingStorageType=accounting_storage/none",
                        "JobRequeue=1",
                        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
                        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                        "",
                    ]
                )
            )
        key = os.path.join(self.dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.daemons = [
            subprocess.Popen(
                [
                    "munged",
                    "-F",
                    f"--key-file={key}",
                    f"--socket={self.dir}/munge.sock",
                    f"--pid-file={self.dir}/munged.pid",
                    f"--seed-file={self.dir}/munge.seed",
                    f"--log-file={self.dir}/munged.log",
                    "-f",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ]
        # cred_expire: how long a killed job's credential stays revoked, which is also how long
        # SLURM holds a requeued job back (120 s by default); 5 s keeps the requeue test short.
        self._wait(lambda: os.path.exists(f"{self.dir}/munge.sock"), "munged")
        for daemon, log in (("slurmctld", "ctld.log"), ("slurmd", "slurmd.log")):
            self.daemons.append(
                subprocess.Popen(
                    [daemon, "-D", "-f", self.conf, "-L", f"{self.dir}/{log}"],
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self._wait(
            lambda: "idle" in self.run("sinfo", "-h", "-o", "%T"), "the node to come up idle"
        )

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                self.stop()
                pytest.skip(f"the test SLURM cluster did not start ({what}); logs in {self.dir}")
            time.sleep(0.2)

    def run(self, *cmd: str, env: dict | None = None, cwd=None) -> str:
        return subprocess.run(
            cmd,
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    def job_state(self, job_id: str) -> str:
        return self.run("scontrol", "-o", "show", "job", job_id).split("JobState=")[1].split()[0]

    def stop(self) -> None:
        """Cancel every job, then stop the daemons. A job's processes are not the daemons' children
        (slurmstepd detaches), so whatever is left of them is found by the SLURM_CONF they
        inherited."""
        self.run("scancel", "--full", "--user=root")
        deadline = time.monotonic() + 30
        while self.run("squeue", "-h") and time.monotonic() < deadline:
            time.sleep(0.2)
        for daemon in reversed(self.daemons):
            daemon.kill()
            daemon.wait(timeout=10)
        marker = f"SLURM_CONF={self.conf}".encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        os.kill(int(pid), 9)
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
