"""Two hosts on one machine: network namespaces joined by a veth pair, for the benchmarks of slow
and broken links (benchmarks/slow_links.py).

Each namespace has its own network stack: its own loopback, one end of the veth pair and an
address (10.77.0.1 and 10.77.0.2), so a process started in it (`ip netns exec NAME ...`) reaches
the other host only over the pair. Taking a link down (`ip link set down`) is a partition: packets
are dropped, TCP connections stay open and resume when it comes back up. `tc`'s token bucket
(tbf) limits the link's rate. Delay and loss (netem) are left out: this kernel has no netem
module (docs/fault-tolerance.md says so). Needs root; `available()` says why not otherwise.
Both namespaces share the machine's hostname, so every address is given explicitly: torchrun's
--local-addr, GLOO_SOCKET_IFNAME, torchft_config.hostname.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

ADDRESSES = ("10.77.0.1", "10.77.0.2")


def available() -> str:
    """ "" when two namespaces can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = f"probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return ""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Hosts:
    """Two namespaces A and B joined by a veth pair, for as long as the `with` lasts."""

    def __init__(self):
        tag = f"h{os.getpid() % 100000}"
        self.names = (f"{tag}A", f"{tag}B")
        self.nics = (f"{tag}a", f"{tag}b")  # each host's end of the pair (its GLOO_SOCKET_IFNAME)
        self.addresses = ADDRESSES

    def __enter__(self) -> Hosts:
        for name in self.names:
            ip("netns", "add", name)
        ip("link", "add", self.nics[0], "type", "veth", "peer", "name", self.nics[1])
        for name, nic, address in zip(self.names, self.nics, ADDRESSES):
            ip("link", "set", nic, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", nic)
            ip("-n", name, "link", "set", nic, "up")
            ip("-n", name, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc) -> None:
        for name in self.names:  # deleting a namespace deletes its end of the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def command(self, host: int, cmd: list[str]) -> list[str]:
        """cmd run on host 0 (A) or 1 (B)."""
        return ["ip", "netns", "exec", self.names[host], *cmd]

    def link(self, up: bool) -> None:
        """Cut the link between the hosts (a partition), or restore it."""
        ip("-n", self.names[0], "link", "set", self.nics[0], "up" if up else "down")

    def partition(self, seconds: float) -> float:
        """The link down for `seconds`, then up: when it came back (time.monotonic). The sleep is
        the outage's length, the fault itself, not a wait standing in for an event."""
        self.link(up=False)
        time.sleep(seconds)
        self.link(up=True)
        return time.monotonic()

    def rate(self, mbit: float) -> None:
        """Limit each direction of the link to mbit megabits a second (tc's token bucket)."""
        for name, nic in zip(self.names, self.nics):
            tbf = ["rate", f"{mbit}mbit", "burst", "64kb", "latency", "400ms"]
            subprocess.run(
                ["tc", "-n", name, "qdisc", "replace", "dev", nic, "root", "tbf", *tbf], check=True
            )
