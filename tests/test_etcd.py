"""Rendezvous through a real etcd server, as the study notes run torchelastic: two torchrun agents
on loopback find each other through etcd instead of c10d's TCP store."""

import subprocess
import sys

import pytest
from conftest import MAIN, lose_a_node, start, tiny_overrides, wait_for_line
from etcd_server import EtcdServer

from mingpt_ddp.runtime.etcd_check import etcd_v2_problem
from mingpt_ddp.snapshots.store import SnapshotStore

pytestmark = pytest.mark.slow


@pytest.fixture
def etcd():
    server = EtcdServer()
    yield server
    server.stop()


def agent(
    backend: str, endpoint: str, nnodes: str, args: list[str], extra=(), run_id="job-1"
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc_per_node=1",
        f"--rdzv_backend={backend}",
        f"--rdzv_endpoint={endpoint}",
        f"--rdzv_id={run_id}",
        "--monitor-interval=0.5",
        *extra,
        MAIN,
        *args,
    ]
    return start(cmd)


def two_agents(backend: str, endpoint: str, args: list[str], run_id: str) -> str:
    """One job of two agents. etcd keeps a finished job's rendezvous (closed) under its run id, so
    each job, a rerun included, needs its own --rdzv_id, as a scheduler's job id gives it."""
    nodes = [agent(backend, endpoint, "2", args, run_id=run_id) for _ in range(2)]
    outs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    return "".join(outs)


# etcd: the original torchelastic handler, the notes' `--rdzv_backend=etcd`; etcd-v2: the same
# dynamic rendezvous that c10d uses, with etcd as its store. Both need etcd's v2 API (--enable-v2).
@pytest.mark.parametrize("backend", ["etcd-v2", "etcd"])
def test_two_agents_meet_through_etcd_train_snapshot_and_resume(
    backend, etcd, shakespeare, tmp_path
):
    out = two_agents(
        backend,
        etcd.endpoint,
        tiny_overrides(shakespeare, tmp_path, max_steps=10, save_every=10),
        "job-1",
    )
    assert "world size 2 | backend gloo" in out and "snapshot | step 10" in out
    out = two_agents(
        backend,
        etcd.endpoint,
        tiny_overrides(shakespeare, tmp_path, max_steps=20, save_every=10),
        "job-2",
    )
    assert "resume | step 10 |" in out and "done | step 20" in out


def test_an_elastic_job_on_etcd_loses_a_node_and_finishes(etcd, shakespeare, tmp_path):
    # 80 steps: the node is lost after the step-40 snapshot; the rest run at world size 1.
    args = tiny_overrides(shakespeare, tmp_path, max_steps=80, save_every=20, log_every=20)
    # keep_alive_interval=1: the lost node's heartbeat is missed for 3 s (3 attempts), not 15 (the
    # default 5 s x 3), before the survivor's new round may leave it out.
    elastic = (
        "--max-restarts=3",
        "--rdzv-conf=last_call_timeout=5,join_timeout=60,keep_alive_interval=1",
    )
    node0 = agent("etcd-v2", etcd.endpoint, "1:2", args, elastic)
    node1 = agent("etcd-v2", etcd.endpoint, "1:2", args, elastic)
    out = lose_a_node(node0, node1, after="snapshot | step 40")
    assert "world size 2 |" in out  # before the loss
    assert node0.returncode == 0, out[-3000:]
    assert (
        "world size 1 | backend" in out
        and "restart 1" in out
        and "saved at world size 2, now 1" in out
    )
    assert "done | step 80" in out


def test_etcd_stopping_mid_job_fails_the_job_clearly_and_loses_no_snapshot(
    etcd, shakespeare, tmp_path
):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=100000, save_every=20, log_every=20)
    nodes = [agent("etcd-v2", etcd.endpoint, "2", args) for _ in range(2)]
    lines = wait_for_line(nodes[0], "snapshot | step 40", timeout=120)
    etcd.stop()  # the rendezvous server goes away; the agents notice at their next check
    outs = [node.communicate(timeout=120)[0] for node in nodes]
    assert all(node.returncode != 0 for node in nodes)
    assert "The connection to etcd has failed" in "".join(outs)
    # Rank 0 was sent SIGTERM by its agent: it saved the step it was on before exiting.
    saved = SnapshotStore(str(tmp_path / "snapshots")).load_latest()["step"]
    assert saved >= 40 and f"snapshot | step {saved}" in "".join(lines) + outs[0]
    restarted = EtcdServer()  # a new etcd: the rerun resumes where the job stopped
    try:
        out = two_agents(
            "etcd-v2",
            restarted.endpoint,
            tiny_overrides(
                shakespeare, tmp_path, max_steps=saved + 10, save_every=20, log_every=20
            ),
            "job-2",
        )
    finally:
        restarted.stop()
    assert f"resume | step {saved} |" in out and f"done | step {saved + 10}" in out


def check_etcd(endpoint: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mingpt_ddp.runtime.etcd_check", endpoint],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_etcd_check_passes_a_v2_server_and_refuses_one_without_v2(etcd):
    assert etcd_v2_problem(etcd.endpoint) == ""  # (the EtcdServer fixture ran the check too)
    plain = EtcdServer(enable_v2=False)
    try:
        assert etcd_v2_problem(plain.endpoint).endswith(
            "runs without its v2 API; start it with --enable-v2"
        )
    finally:
        plain.stop()


def test_the_etcd_check_refuses_etcd_3_6_which_removed_the_v2_api():
    # No etcd 3.6 binary is packaged for pip; a loopback server answering /version as 3.6 does
    # stands in for it (the check reads nothing else before refusing).
    import http.server
    import threading

    class Etcd36(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (
                b'{"etcdserver":"3.6.1","etcdcluster":"3.6.0"}'
                if self.path == "/version"
                else b"404"
            )
            self.send_response(200 if self.path == "/version" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Etcd36)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = check_etcd(f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "etcd 3.6.1 at http://127.0.0.1:" in result.stderr
    assert (
        "has no v2 API (etcd 3.6 removed it)" in result.stderr
        and "--rdzv_backend=c10d" in result.stderr
    )
