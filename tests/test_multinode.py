"""Multi-node jobs on one machine: torchrun agents meeting through c10d rendezvous.

Each `torchrun` agent plays one node. On loopback they share 127.0.0.1; in the
network-namespace variant each "node" has its own network stack and IP address
and they talk over a veth pair, as two hosts on a LAN would. The snapshot
directory is shared (like NFS), and only global rank 0 writes to it.
"""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from conftest import MAIN, free_port, lose_a_node, start, tiny_overrides

pytestmark = pytest.mark.slow


def agent_cmd(endpoint: str, nnodes: str, *args: str, extra=()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
        "--rdzv_id=test-job",
        *extra,
        MAIN,
        *args,
    ]


def start_agent(cmd, prefix=()) -> subprocess.Popen:
    return start([*prefix, *cmd])


def hosting(agent: subprocess.Popen, endpoint: str, timeout: float = 60) -> None:
    """Wait until agent (node 0) serves the rendezvous store at endpoint: the agent that binds the
    port first hosts it, and the test loses node 1, never the host."""
    host, port = endpoint.split(":")
    deadline = time.monotonic() + timeout
    while agent.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"node 0 does not serve the rendezvous store at {endpoint}")


def run_two_agents(make_cmd, endpoint=None, timeout=180) -> tuple[str, str]:
    """Start node 0 (which hosts the rendezvous store, once it does: endpoint), then node 1;
    return both outputs."""
    first = start_agent(*make_cmd(0))
    if endpoint is not None:  # else the command says who hosts (is_host)
        hosting(first, endpoint)
    second = start_agent(*make_cmd(1))
    outs = [p.communicate(timeout=timeout)[0] for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    return outs[0], outs[1]


def test_two_agents_on_loopback_train_snapshot_and_resume(shakespeare, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"

    def make(max_steps):
        args = tiny_overrides(shakespeare, tmp_path, max_steps=max_steps, save_every=10)
        return lambda node: (agent_cmd(endpoint, "2", *args),)

    out0, out1 = run_two_agents(make(10), endpoint)
    assert "world size 4 | backend gloo" in out0 and "snapshot | step 10" in out0
    assert "snapshot |" not in out1  # node 1 has no global rank 0: it never writes
    out0, _ = run_two_agents(make(20), endpoint)
    assert (
        "resume | step 10 | epoch 0 | 160 samples into the epoch | saved at world size 4, now 4"
        in out0
    )
    assert "done | step 20" in out0


def test_elastic_job_loses_a_node_and_finishes_at_the_smaller_world_size(shakespeare, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    # 80 steps: the node is lost after the step-40 snapshot; the rest run at world size 2.
    args = tiny_overrides(shakespeare, tmp_path, max_steps=80, save_every=20, log_every=20)
    # keep_alive_interval=1: the lost node's heartbeat is missed for 3 s (3 attempts), not 15 (the
    # default 5 s x 3), before the survivor's new round may leave it out.
    elastic = (
        "--max-restarts=3",
        "--monitor-interval=0.5",
        "--rdzv-conf=last_call_timeout=5,join_timeout=60,keep_alive_interval=1",
    )
    node0 = start_agent(agent_cmd(endpoint, "1:2", *args, extra=elastic))
    hosting(node0, endpoint)
    node1 = start_agent(agent_cmd(endpoint, "1:2", *args, extra=elastic))
    out = lose_a_node(node0, node1, after="snapshot | step 40")
    assert "world size 4 |" in out  # before the loss
    assert node0.returncode == 0, out[-3000:]
    assert (
        "job | world size 2 | backend gloo | device cpu | 1 CPU threads per rank | restart 1" in out
    )
    assert "rank 2 died without a word" in out and "rank 3 died without a word" in out
    assert "saved at world size 4, now 2" in out
    assert "global batch kept at 16 windows = 4 per rank x 2 ranks x 2 accumulation steps" in out
    assert "done | step 80" in out


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: hosts 10.231.0.1 and 10.231.0.2."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = f"{os.getpid() % 100000}"
    ns, veth = [f"mgpt{tag}a", f"mgpt{tag}b"], [f"mgv{tag}a", f"mgv{tag}b"]
    setup = [
        ["ip", "netns", "add", ns[0]],
        ["ip", "netns", "add", ns[1]],
        ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]],
    ]
    for i in (0, 1):
        setup += [
            ["ip", "link", "set", veth[i], "netns", ns[i]],
            [
                "ip",
                "netns",
                "exec",
                ns[i],
                "ip",
                "addr",
                "add",
                f"10.231.0.{i + 1}/24",
                "dev",
                veth[i],
            ],
            ["ip", "netns", "exec", ns[i], "ip", "link", "set", veth[i], "up"],
            ["ip", "netns", "exec", ns[i], "ip", "link", "set", "lo", "up"],
        ]
    try:
        for cmd in setup:
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                pytest.skip(
                    f"network namespaces not permitted here: {' '.join(cmd)}: "
                    f"{result.stderr.strip()}"
                )
        yield [(ns[i], veth[i], f"10.231.0.{i + 1}") for i in (0, 1)]
    finally:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_two_hosts_in_network_namespaces_train_over_a_veth_link(two_hosts, shakespeare, tmp_path):
    endpoint = f"{two_hosts[0][2]}:{free_port()}"
    args = tiny_overrides(shakespeare, tmp_path, max_steps=10, save_every=10)

    def make(node):
        ns, veth, addr = two_hosts[node]
        # is_host: node 0 serves the rendezvous store (its address is the endpoint);
        # GLOO_SOCKET_IFNAME: the interface gloo's connections use on each host.
        prefix = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={veth}"]
        extra = (f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}", f"--local_addr={addr}")
        return agent_cmd(endpoint, "2", *args, extra=extra), prefix

    out0, _ = run_two_agents(make)
    assert "world size 4 | backend gloo" in out0 and "done | step 10" in out0
